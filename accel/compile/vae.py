"""Compile VAE: the VAE's encode and decode run through the shared compiled-graph registry.

ComfyUI's VAE has a ModelPatcher of its own (`vae.patcher`) that it loads before every encode/decode, and a
ModelPatcher applies its object patches while loaded and restores them when unloaded. So a copy of the VAE with
a cloned patcher whose object patches replace `decode`/`encode` gives compiled coding to that copy only; the
input VAE is untouched.

With choose=auto and a background compile (the defaults), the first decode (or encode) of a VAE kind with nothing
in the persistent compile cache runs eagerly and is captured for the background child, like a block kind
(dispatch.py): a workflow's first prompt no longer waits for the VAE's compile. Its next calls load the child's
graphs and auto mode times compiled against eager as for blocks. Each call takes the route its kind is given
(routes.py), as a block does; the VAE has no profile or whole-call check, one kind per method.
"""
from __future__ import annotations

import copy

from .. import comfy_names, dynamic_vram, telemetry
from ..cache import COMPILE_CACHE
from .background import BACKGROUND, Capture, hold_until_idle
from .blocks import BlockKind
from .dispatch import (IN_BACKGROUND, LOADS_BETWEEN_PROMPTS, NEW_SHAPE_IN_BACKGROUND, new_shape_goes_to_child,
                       run_on_chosen_path)
from .dynamo_runner import WOULD_COMPILE
from .kinds import KindEntry
from .shapes import input_signature, steady_unit_strides
from .options import CompileOptions
from .policy import device_policy, effective_options, warn_once
from .registry import REGISTRY
from .routes import CallMode, CallPlan, Route
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
        # the compiled call's inputs built as a block's are (dispatch.BlockDispatcher._make_call): size-1 dimensions
        # get steady strides (shapes.steady_unit_strides), so the two routes' compiled calls, captures and signatures
        # are alike. ComfyUI's decodes (a batch slice of the latent) and image encodes (a slice of the pixels, their
        # channels moved first) have the steady batch stride already; a video VAE's encode, its frames moved and
        # unsqueezed into a batch of 1 (batch stride 3), gets the steady view: the same elements.
        def make_call():
            return steady_unit_strides(args, kwargs)

        def run_compiled():
            return entry.run_compiled(self.module, make_call, args, kwargs)

        always = options.choose == "always compiled"
        background = not always and options.compiles_in_background and policy.allows("background_compile")
        if background:
            BACKGROUND.poll()  # a finished child hands the kind back here
        plan = CallPlan(CallMode.DISPATCH, always, background, device.type, new_shapes_in_background=background,
                        compiles_in_background=background).fill_routes([entry])
        route = plan.routes[entry.key]
        if route is Route.BACKGROUND:
            if self._compiling_in_background(entry, make_call, device):
                return entry.run_eager(self.module, args, kwargs, IN_BACKGROUND)
            route = plan.reroute(entry)  # it could not be sent: compiled here
        if route is Route.LOADING:
            return entry.run_eager(self.module, args, kwargs, LOADS_BETWEEN_PROMPTS)
        if route is Route.COMPILED:
            return run_compiled()
        if route is Route.CHOSEN_OFF_PROMPT and entry.can_refuse_compiles:
            return run_on_chosen_path(entry, self.module, args, kwargs, device.type,
                                      lambda: self._compiled_or_eager(entry, make_call, args, kwargs, device))
        return run_on_chosen_path(entry, self.module, args, kwargs, device.type, run_compiled)

    def _compiled_or_eager(self, entry: KindEntry, make_call, args: tuple, kwargs: dict, device):
        """A decode (or encode) of a new size does not compile in the prompt: as a block's call (dispatch.py)."""
        out = entry.run_compiled(self.module, make_call, args, kwargs, may_compile=False)
        if out is not WOULD_COMPILE:
            return out
        captures = {}
        if not new_shape_goes_to_child(entry, self.module, self.method, make_call, captures):
            return entry.run_compiled(self.module, make_call, args, kwargs)
        if captures:
            BACKGROUND.launch(list(captures.values()), COMPILE_CACHE.environment(device.type).dir,
                              hold=hold_until_idle(device.type))
        return entry.run_eager(self.module, args, kwargs, NEW_SHAPE_IN_BACKGROUND)

    def _compiling_in_background(self, entry: KindEntry, make_call, device) -> bool:
        """True while this VAE kind compiles in a child, and for the call that sends it there (its first, when
        the kind is cold). On a CPU with few cores the child starts once this process is idle (the decode and
        the rest of the prompt done: background/idle_gate.py), as the sampler's do."""
        if not entry.background.undecided:  # a child has it (or it waits for inductor's CPU checks)
            return entry.background.waiting
        capture = Capture.in_this_call(entry, self.module, self.method)
        entry.background.capture()
        call_args, call_kwargs = make_call()
        capture.add_call(input_signature(call_args, call_kwargs), call_args, call_kwargs)
        return BACKGROUND.launch([capture], COMPILE_CACHE.environment(device.type).dir,
                                 hold=hold_until_idle(device.type))


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
