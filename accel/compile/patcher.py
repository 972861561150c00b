"""Hooking compiled blocks into a ComfyUI ModelPatcher through its public wrapper mechanism.

`compile_model` returns a clone with an APPLY_MODEL wrapper (and an OUTER_SAMPLE one that only marks the
sampling run, so background work held for an idle moment never starts inside it:
background/idle_gate.py). For the duration of each apply_model call the
wrapper gives every repeated block an instance-level `forward` (dispatch.BlockDispatcher) that carries out the
call's plan (auto_mode.plan_call), and removes it afterwards. Nothing global is patched and the model is left as
it was between calls, so ComfyUI can load, partially load, unload and patch it (LoRA) as usual.

APPLY_MODEL is outside DIFFUSION_MODEL: a DIFFUSION_MODEL wrapper that runs its own UNet loop (DeepCache)
still calls the blocks through their module call, so it gets the compiled blocks whatever the node order.

The walk: wrapper (this module) -> the model's record (model_record.py) -> the call's plan (auto_mode.py), with
each kind's route in it (routes.py) -> per block, its dispatcher (dispatch.py) -> its kind's entry (kinds.py);
accel/compile/README.md draws it.
"""
from __future__ import annotations

import logging
import time

from .. import comfy_names, dynamic_vram, telemetry
from ..malloc.step_faults import STEP_FAULTS
from ..malloc.tune import ensure_tuned
from . import object_patches
from .attention import compiled_block_options
from .auto_mode import abandon_call, finish_call, inputs_key, plan_call, start_call
from .background import IDLE_GATE
from .background.decision import saves_compiled
from .blocks import PATCHED, UNKNOWN_PATCH, cannot_compile_reason, scan_attention_holders
from .cuda_graphs import finish_graphs, plan_graphs, warn_if_off
from .dispatch import dispatcher_class
from .kinds import wait_for_device
from .model_record import model_record
from .options import CompileOptions
from .policy import device_policy, effective_options, warn_once
from .registry import REGISTRY
from .status import note_calls, note_owner

WRAPPER_KEY = "accel.compile_model"
log = logging.getLogger("comfyui_accel")


def compile_model(patcher, options: CompileOptions, owner: str | None = None):
    """A clone of `patcher` whose diffusion model runs compiled blocks. Compiles nothing yet. `owner` (the web
    UI's node id) is who status.py reports this model's state to."""
    import comfy.patcher_extension

    ensure_tuned()  # the malloc tune (ACCEL_MALLOC_TUNE), decided once per process: here, never at import
    # Dynamic VRAM's per-op casts cannot be traced (accel/dynamic_vram.py): the model leaves it, as core's
    # TorchCompileModel does, or stays and runs eagerly.
    source, kept_because = dynamic_vram.leave(patcher, "Compile Model")
    model = source.clone()
    if kept_because is not None:
        dynamic_vram.warn_kept_eager("Compile Model", kept_because)
        dynamic_vram.note(model.model, dynamic_vram.kept_eager_placement(kept_because))
    elif source is not patcher:
        dynamic_vram.note(model.model, dynamic_vram.left_placement())
    note_owner(owner, model.model, choose=options.choose)
    scan_attention_holders()  # now, not in a timed model call
    wrappers = comfy.patcher_extension.WrappersMP
    for kind, wrapper in ((wrappers.APPLY_MODEL, CompiledApplyModel(options, owner)),
                          (wrappers.OUTER_SAMPLE, mark_sampling_run)):
        model.remove_wrappers_with_key(kind, WRAPPER_KEY)  # compiling twice replaces, never stacks
        model.add_wrapper_with_key(kind, WRAPPER_KEY, wrapper)
    return model


def mark_sampling_run(executor, *args, **kwargs):
    """OUTER_SAMPLE: background work held for an idle moment (few CPU cores) waits while the sampler runs; its
    end, however it ends, lets the gate look for the idle moment after it. The run's page faults per step are
    counted for the stats (malloc/step_faults.py)."""
    IDLE_GATE.sampling_started()
    try:
        with object_patches.run_patches(executor.class_obj):
            return STEP_FAULTS.counted_run(executor, args, kwargs)
    finally:
        IDLE_GATE.sampling_ended()
        telemetry.record("compile_model", "run")  # the models' states may have moved (status.py)


class CompiledApplyModel:
    """The APPLY_MODEL wrapper. Holds only the options: all compiled state lives in the registry and the
    model's record."""

    def __init__(self, options: CompileOptions, owner: str | None = None):
        self.options, self.owner = options, owner

    def __call__(self, executor, *args, **kwargs):
        base_model = executor.class_obj
        x = args[0] if args else kwargs["x"]
        if comfy_names.attr(base_model, "diffusion_model", "BaseModel.diffusion_model") is None:
            return executor(*args, **kwargs)
        policy = device_policy(x.device)
        if not policy.allows("compile"):
            warn_once(x.device, "compile", f"the model runs eagerly: {policy.explain('compile')}")
            return executor(*args, **kwargs)
        if dynamic_vram.runs_dynamic(base_model):  # still dynamic: never traced under aimdo's casts
            placement = dynamic_vram.placement_of(base_model)
            if placement is None or not placement.eager:  # one that could not leave was warned of already
                dynamic_vram.warn_running_dynamic("Compile Model")
                dynamic_vram.note(base_model, dynamic_vram.running_dynamic_placement())
            return executor(*args, **kwargs)
        options = effective_options(self.options, policy, x.device)
        record = model_record(base_model, options, x.device, self.options.whole_model)
        background = options.compiles_in_background and policy.allows("background_compile")
        inputs = inputs_key(args, kwargs)
        plan = plan_call(record, options.choose == "always compiled", background, x.device.type, inputs)
        if plan is None:
            return executor(*args, **kwargs)
        plan.block_options = compiled_block_options(policy.allows("sdpa_in_compiled_blocks"))  # once a call
        plan.saves_compiled = saves_compiled(options, policy.allows("background_compile"),  # compiles saved whole
                                             REGISTRY.recorded is not None)
        progress = _progress_bar(plan.compiles_here)
        # A fully loaded model (ComfyUI's model_lowvram flag unset) has every weight on the compute device, so
        # the per-block offload check is only needed after a partial load.
        partial = comfy_names.attr(base_model, "model_lowvram", "BaseModel.model_lowvram", True)
        patched = object_patches.patched_paths(base_model)
        warn_if_off(options, policy, x.device)
        plan.graphs = plan_graphs(record, plan.routes, plan.always_compiled, policy, x.device.type, partial)
        timed = plan.timed or (plan.graphs is not None and plan.graphs.side is not None)
        installed, own_forwards = [], 0
        dispatcher = dispatcher_class()  # precompile's recording (dispatch.RecordingDispatcher), asked once a call
        start_call(record, plan)
        try:
            for site, entry in zip(record.sites, record.entries):
                if site.attribute in site.module.__dict__:
                    # Another node's own forward, set on this block: it runs as that node made it, and stays
                    # (a dispatcher here would run the class's forward, then take that node's away with it).
                    own_forwards += 1
                    continue
                reason = (object_patches.reason(site.path, patched) if patched else None) or (
                    cannot_compile_reason(site.module, x.device) if partial else None)
                site.module.__dict__[site.attribute] = dispatcher(site, entry, plan, reason, progress)
                installed.append(site)
            if patched:
                object_patches.warn_once(record.label, patched, sum(
                    object_patches.reason(site.path, patched) is not None for site in record.sites))
            if timed:
                wait_for_device(x.device.type)
            start = time.perf_counter()
            out = executor(*args, **kwargs)
            if timed:
                wait_for_device(x.device.type)
            seconds = time.perf_counter() - start
        except BaseException:
            abandon_call(plan)
            raise
        finally:
            for site in installed:
                site.module.__dict__.pop(site.attribute, None)
        finish_call(record, plan, seconds, (tuple(x.shape), str(x.dtype)), inputs)
        finish_graphs(record, plan.graphs, seconds, (tuple(x.shape), str(x.dtype), plan.blocks))
        if own_forwards:
            record.last_call.setdefault("eager", {})[OWN_FORWARD] = own_forwards
        for reason in note_calls(self.owner, record.last_call):
            if reason.startswith(PASS_THROUGH_REASONS):
                passed_through(self.owner, reason)
        return out


OWN_FORWARD = "another node set the block's own forward"
# The eager reasons that are another node's patch the pack passes through: said once per node and reason.
PASS_THROUGH_REASONS = (PATCHED, UNKNOWN_PATCH, OWN_FORWARD)


def passed_through(owner: str | None, reason: str) -> None:
    """One line, the first time a Compile Model node's calls meet another node's patch, and a count in the stats
    (`compile_model.passed_through`): those block calls run eagerly, as ComfyUI runs them, so the patch applies."""
    where = f" (node {owner})" if owner else ""
    say = log.warning if reason.startswith((UNKNOWN_PATCH, OWN_FORWARD)) else log.info
    say("[Accel] Compile Model%s: block calls run eagerly where %s, so it applies as without the pack; the others "
        "stay compiled.", where, reason)
    telemetry.record("compile_model", "passed_through", node=owner, reason=reason)


def _progress_bar(pending: int):
    """ComfyUI's progress bar over the block kinds still to compile, when some are (none when warm)."""
    if not pending:
        return None
    import comfy.utils

    return comfy.utils.ProgressBar(pending)
