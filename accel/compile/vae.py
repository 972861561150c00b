"""Compile VAE: the VAE's encode and decode run through the shared compiled-graph registry.

ComfyUI's VAE has a ModelPatcher of its own (`vae.patcher`) that it loads before every encode/decode, and a
ModelPatcher applies its object patches while loaded and restores them when unloaded. So a copy of the VAE with
a cloned patcher whose object patches replace `decode`/`encode` gives compiled coding to that copy only; the
input VAE is untouched.
"""
from __future__ import annotations

import copy

from .blocks import BlockKind
from .options import CompileOptions
from .policy import device_policy, effective_options, warn_once
from .dispatch import run_on_chosen_path
from .registry import REGISTRY

VAE_METHODS = ("decode", "encode")


class CompiledMethod:
    """Stands in for `module.<method>` while the VAE's patcher is loaded."""

    def __init__(self, module, method: str, options: CompileOptions):
        self.module, self.method, self.options = module, method, options
        self.kind = BlockKind.of(module, method)

    def __call__(self, *args, **kwargs):
        device = next(self.module.parameters()).device
        policy = device_policy(device)
        if not policy.allows("compile"):
            warn_once(device, "compile", f"the VAE runs eagerly: {policy.explain('compile')}")
            return getattr(type(self.module), self.method)(self.module, *args, **kwargs)
        options = effective_options(self.options, policy, device)
        entry = REGISTRY.entry(self.kind, getattr(type(self.module), self.method), options, device)

        def run_compiled():
            return entry.run_compiled(self.module, lambda: (args, kwargs), args, kwargs)

        if options.choose == "always compiled":
            return run_compiled()
        return run_on_chosen_path(entry, self.module, args, kwargs, device.type, run_compiled)


def compile_vae(vae, options: CompileOptions):
    """A copy of `vae` whose first-stage model encodes and decodes compiled. Compiles nothing yet."""
    compiled = copy.copy(vae)
    compiled.patcher = vae.patcher.clone()
    model = vae.first_stage_model
    for method in VAE_METHODS:
        if callable(getattr(type(model), method, None)):
            compiled.patcher.add_object_patch(method, CompiledMethod(model, method, options))
    return compiled
