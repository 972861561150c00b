"""Compile VAE: the VAE's encode and decode run through the shared compiled-graph registry.

ComfyUI's VAE has a ModelPatcher of its own (`vae.patcher`) that it loads before every encode/decode, and a
ModelPatcher applies its object patches while loaded and restores them when unloaded. So a copy of the VAE with
a cloned patcher whose object patches replace `decode`/`encode` gives compiled coding to that copy only; the
input VAE is untouched.

With choose=auto and a background compile (the defaults), the first decode (or encode) of a VAE kind with nothing
in the persistent compile cache runs eagerly and is captured for the background child, like a block kind
(dispatch.py): a workflow's first prompt no longer waits for the VAE's compile. Its next calls load the child's
graphs and auto mode times compiled against eager as for blocks. Each call is planned (routes.CallPlan) and run by
the blocks' dispatcher (dispatch.BlockDispatcher), its captures sent when it ends; the VAE has no profile or
whole-call check, one kind per method.
"""
from __future__ import annotations

import copy

from dataclasses import dataclass

from .. import comfy_names, dynamic_vram, telemetry
from .auto_mode import abandon_call, send_captures
from .background import BACKGROUND
from .background.decision import saves_compiled
from .blocks import BlockKind
from .dispatch import BlockDispatcher
from .kinds import KindEntry
from .options import CompileOptions
from .policy import device_policy, effective_options, warn_once
from .registry import REGISTRY
from .routes import CallMode, CallPlan
from .shapes import CompiledCall, compiled_call, steady_unit_strides
from .status import VAE, note_owner

VAE_METHODS = ("decode", "encode")


class CompiledMethod:
    """Stands in for `module.<method>` while the VAE's patcher is loaded."""

    def __init__(self, module, method: str, options: CompileOptions):
        self.module, self.method, self.options = module, method, options
        self.kind = BlockKind.of(module, method)
        self.entry: KindEntry | None = None  # the registry's entry of its latest call (status.py)

    def skeleton_stand_in(self) -> tuple:
        """While the VAE's patcher is loaded this object is the module's `decode`/`encode` attribute, so it is
        pickled with the module when a call is captured for the background child: there it is ComfyUI's own
        method (background/skeleton.py), a pickle reduce tuple."""
        return getattr, (type(self.module), self.method)

    def __call__(self, *args, **kwargs):
        device = next(self.module.parameters()).device
        policy = device_policy(device)
        if not policy.allows("compile"):
            warn_once(device, "compile", f"the VAE runs eagerly: {policy.explain('compile')}")
            return getattr(type(self.module), self.method)(self.module, *args, **kwargs)
        options = effective_options(self.options, policy, device)
        entry = REGISTRY.entry(self.kind, getattr(type(self.module), self.method), options, device)
        before = _where(entry) if entry is self.entry else None
        self.entry = entry
        try:
            return self._run(entry, options, policy, device, args, kwargs)
        finally:
            if _where(entry) != before:  # the Compile VAE node's status may have moved (status.py)
                telemetry.record("compile_vae", "moved", method=self.method)

    def _run(self, entry: KindEntry, options: CompileOptions, policy, device, args: tuple, kwargs: dict):
        """The call planned as a block call is (one kind, no profile or whole-call check) and run by the same
        dispatcher; what it captured for a child is sent when it ends, as a model call's captures are."""
        always = options.choose == "always compiled"
        background = not always and options.compiles_in_background and policy.allows("background_compile")
        if background:
            BACKGROUND.poll()  # a finished child hands the kind back here
        plan = CallPlan(CallMode.DISPATCH, always, background, device.type, new_shapes_in_background=background,
                        compiles_in_background=background,
                        saves_compiled=saves_compiled(options, policy.allows("background_compile"),
                                                      REGISTRY.recorded is not None)).fill_routes([entry])
        try:
            out = BlockDispatcher(CodingSite(self.module, self.method), entry, plan)(*args, **kwargs)
        except BaseException:
            abandon_call(plan)
            raise
        send_captures(plan)
        return out


@dataclass(frozen=True)
class CodingSite:
    """A VAE coding method as the dispatcher sees a block (blocks.BlockSite): its module and method, and the
    per-call answer, which for a VAE is always its compiled call (ComfyUI's VAE takes no transformer_options and no
    node patches it). Size-1 dimensions get steady strides (shapes.steady_unit_strides), as a block's inputs do, so
    the routes' compiled calls, captures and signatures are alike. ComfyUI's decodes (a batch slice of the latent)
    and image encodes (a slice of the pixels, their channels moved first) have the steady batch stride already; a
    video VAE's encode, its frames moved and unsqueezed into a batch of 1 (batch stride 3), gets the steady view:
    the same elements."""
    module: object
    attribute: str

    def compiled_call(self, args: tuple, kwargs: dict, block_options: dict) -> CompiledCall:
        return compiled_call(args, kwargs, lambda: steady_unit_strides(args, kwargs))


def _where(entry: KindEntry) -> tuple:
    """What the status of a VAE's method is made of, to tell when it moved."""
    return (entry.background.state, entry.choice.path, entry.choice.progress(), entry.ran_compiled,
            entry.failure)


def compile_vae(vae, options: CompileOptions, owner: str | None = None):
    """A copy of `vae` whose first-stage model encodes and decodes compiled. Compiles nothing yet. `owner` (the
    web UI's node id) is who status.py reports this copy's state to."""
    if comfy_names.missing(vae, ("patcher", "first_stage_model"), "VAE.patcher, VAE.first_stage_model"):
        return vae  # a newer ComfyUI's VAE, kept otherwise: it decodes as ComfyUI made it
    compiled = copy.copy(vae)
    # Dynamic VRAM's per-op casts cannot be traced (accel/dynamic_vram.py): the copy leaves it with a regular
    # patcher of its own model, or stays and codes eagerly.
    patcher, kept_because = dynamic_vram.leave(vae.patcher, "Compile VAE")
    compiled.patcher = patcher.clone()
    note_owner(owner, compiled, VAE, options.choose, methods_of=method_entries)
    if kept_because is not None:
        dynamic_vram.warn_kept_eager("Compile VAE", kept_because)
        dynamic_vram.note(compiled, dynamic_vram.kept_eager_placement(kept_because))
        return compiled
    if patcher is not vae.patcher:
        compiled.first_stage_model = compiled.patcher.model  # the reloaded model is the one its patcher loads
        dynamic_vram.note(compiled, dynamic_vram.left_placement())
    model = compiled.first_stage_model
    for method in VAE_METHODS:
        if callable(getattr(type(model), method, None)):
            compiled.patcher.add_object_patch(method, CompiledMethod(model, method, options))
    return compiled


def method_entries(vae) -> list[tuple[str, KindEntry | None]]:
    """Each compiled coding method of a VAE copy made by compile_vae: its name and the registry entry of its latest
    call (status.py)."""
    return [(patch.method, patch.entry) for patch in vae.patcher.object_patches.values()
            if isinstance(patch, CompiledMethod)]
