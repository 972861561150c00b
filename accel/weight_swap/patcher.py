"""Swap Weights on a ComfyUI ModelPatcher, through ComfyUI's public extension points only.

`swap_weights(patcher, source)` checks the source against the model (nothing changes when it does not fit) and
returns a clone that carries the swap: an attachment naming the source, a new weight identity (`patches_uuid`, so
ComfyUI re-patches when it loads, as for a LoRA), an ON_LOAD callback that streams the new weights in (ledger.py)
and a PREPARE_SAMPLING wrapper that keeps them in place between swapped clones. The input patcher is untouched;
attachments, callbacks and wrappers follow the clone through LoRA loaders, Compile Model and other nodes.

The swap itself happens when ComfyUI loads the clone, so it always meets the model in its current load state
(loaded, partially loaded, unloaded) and a swap of an unloaded model waits for the load that needs it.
"""
from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field

from .. import comfy_names, dynamic_vram, telemetry
from .ledger import ledger_for
from .model_source import ModelWeights
from .sources import WeightsFile
from .validate import check_fits

log = logging.getLogger("comfyui_accel")
KEY = "accel.swap_weights"
# One swap at a time in the whole process: queued prompts, API calls and threads never interleave two swaps
# (re-entrant: the ON_LOAD swap runs inside the PREPARE_SAMPLING wrapper's hold).
SWAP_LOCK = threading.RLock()


@dataclass
class SwapPlan:
    source: WeightsFile | ModelWeights
    origin_hints: list[str] = field(default_factory=list)  # files the model was probably loaded from
    owner: str | None = None  # who asked for it (the web UI's node id), named in its events


def swap_weights(patcher, source, origin_hints: list[str] | None = None, owner: str | None = None):
    """A clone of `patcher` whose base weights become `source`'s when ComfyUI loads it. Raises ValueError, with
    the input untouched, when the source does not fit the model. `owner` names the asker in the events."""
    import comfy.patcher_extension as ext

    patcher = _non_dynamic(patcher)
    _check_comfyui(patcher)
    check_fits(source, patcher)
    out = _without_swap(patcher)
    out.set_attachments(KEY, SwapPlan(source, list(origin_hints or []), owner))
    out.add_callback_with_key(ext.CallbacksMP.ON_LOAD, KEY, _on_load)
    out.add_wrapper_with_key(ext.WrappersMP.PREPARE_SAMPLING, KEY, _prepare_sampling)
    telemetry.record("swap_weights", "prepared", source=source.label, kind=source.kind, node=owner)
    log.info("[Accel] Swap Weights: %s fits the model; its weights are streamed in when the model loads", source.label)
    return out


def swap_from_model(patcher, weights_model, origin_hints: list[str] | None = None, owner: str | None = None):
    """Swap to another MODEL's base weights. A swapped MODEL gives its source; a clone of the same model gives the
    original weights back."""
    plan = weights_model.get_attachment(KEY)
    if plan is not None:
        return swap_weights(patcher, plan.source, origin_hints, owner)
    if weights_model.model is patcher.model:
        telemetry.record("swap_weights", "prepared", source="original weights", kind="origin", node=owner)
        return _without_swap(patcher)
    return swap_weights(patcher, ModelWeights(weights_model), origin_hints, owner)


def plan_of(patcher) -> SwapPlan | None:
    return patcher.get_attachment(KEY)


def _without_swap(patcher):
    """A clone with no swap of ours and a weight identity of its own: ComfyUI re-patches its weights when it loads,
    the rule `add_patches` follows, so it never reuses weights another clone left in place."""
    import comfy.patcher_extension as ext

    out = patcher.clone()
    out.remove_attachments(KEY)
    out.remove_callbacks_with_key(ext.CallbacksMP.ON_LOAD, KEY)
    out.remove_wrappers_with_key(ext.WrappersMP.PREPARE_SAMPLING, KEY)
    out.patches_uuid = uuid.uuid4()
    return out


# What of ComfyUI a swap writes through (comfy_names.NAMES): object -> (attributes, its name in NAMES)
PATCHER_NAMES = {
    "ModelPatcher.backup (entries of weight, inplace_update)": ("backup",),
    "ModelPatcher.patches": ("patches",),
    "ModelPatcher.patches_uuid (written)": ("patches_uuid",),
    "ModelPatcher.patch_weight_to_device, unpatch_model, offload_device": ("patch_weight_to_device", "unpatch_model",
                                                                          "offload_device"),
}
MODEL_NAMES = {
    "BaseModel.diffusion_model": ("diffusion_model",),
    "BaseModel.current_weight_patches_uuid (Swap Weights)": ("current_weight_patches_uuid",),
    "BaseModel.model_type, model_config (model_type(), sampling_settings)": ("model_type", "model_config"),
}
MODULE_NAMES = {
    "comfy.utils.get_attr, copy_to_param": ("comfy.utils", ("get_attr", "copy_to_param")),
    "comfy.model_patcher.get_key_weight": ("comfy.model_patcher", ("get_key_weight",)),
    "comfy.model_detection.unet_prefix_from_state_dict": ("comfy.model_detection", ("unet_prefix_from_state_dict",)),
    "comfy.model_management.throw_exception_if_processing_interrupted": (
        "comfy.model_management", ("throw_exception_if_processing_interrupted",)),
}


def _check_comfyui(patcher) -> None:
    """Raise ValueError, before anything changes, where this ComfyUI lacks what a swap writes through: a model
    passed through unswapped would give another picture than the one asked for."""
    import importlib

    gone = []
    for name, attributes in PATCHER_NAMES.items():
        gone += comfy_names.missing(patcher, attributes, name)
    for name, attributes in MODEL_NAMES.items():
        gone += comfy_names.missing(patcher.model, attributes, name)
    for name, (module, attributes) in MODULE_NAMES.items():
        gone += [f"{module}.{a}" for a in comfy_names.missing(importlib.import_module(module), attributes, name)]
    if gone:
        raise ValueError(f"Swap Weights: ComfyUI {comfy_names.comfyui_version()} has no {', '.join(gone)}, which "
                         "Swap Weights writes the weights through (docs/comfyui_compat.md); this version of the pack "
                         "cannot swap weights on it: use a ComfyUI it was checked on, or update the pack.")


def _non_dynamic(patcher):
    # Newer ComfyUI on NVIDIA streams weights per op from host memory (dynamic VRAM); an in-place swap needs
    # ordinary resident parameters, so such a model leaves it, as core TorchCompileModel does (dynamic_vram.py).
    out, kept_because = dynamic_vram.leave(patcher, "Swap Weights")
    if kept_because is not None:
        raise ValueError(f"Swap Weights needs the model outside dynamic VRAM (comfy-aimdo streams its weights per "
                         f"op), and it could not be reloaded outside it ({kept_because}). Load the model with a core "
                         f"loader, or start ComfyUI with {dynamic_vram.FLAG}.")
    return out


def _on_load(patcher, device_to, lowvram_model_memory, force_patch_weights, full_load):
    plan = plan_of(patcher)
    if plan is None:
        return
    with SWAP_LOCK:
        ledger = ledger_for(patcher)
        ledger.last = {}
        try:
            stats = ledger.sync(patcher, plan.source, plan.origin_hints, force_patch_weights)
        except BaseException as err:
            telemetry.record("swap_weights", "rolled_back", source=plan.source.label, node=plan.owner,
                             tensors_done=ledger.last.get("tensors", 0), reason=f"{type(err).__name__}: {err}"[:300])
            log.warning("[Accel] Swap Weights: swapping in %s stopped (%s: %s); the model's original weights "
                        "are restored", plan.source.label, type(err).__name__, err)
            raise
        if stats["tensors"]:  # recorded under the lock: event times never overlap another swap's
            telemetry.record("swap_weights", "swapped", node=plan.owner, **stats)
        elif plan.owner is not None:  # the web UI still says which weights the model has
            telemetry.record("swap_weights", "in_place", node=plan.owner, source=plan.source.label)
    if stats["tensors"]:
        log.info("[Accel] Swap Weights: %s in %.2f s (%d tensors, %.0f MB%s)", stats["source"], stats["seconds"],
                 stats["tensors"], stats["bytes"] / 2**20,
                 f"; {stats['spilled']} originals spilled to disk" if stats["spilled"] else "")


def _prepare_sampling(executor, model, *args, **kwargs):
    """Around ComfyUI's model loading for a sampling run: hold the swap lock, and keep a swapped base that this
    clone also wants in place across ComfyUI's unpatch."""
    with SWAP_LOCK:
        ledger = ledger_for(model) if plan_of(model) is not None else None
        try:
            if ledger is not None and ledger.origin is not None:
                ledger.park(model)
            return executor(model, *args, **kwargs)
        finally:
            if ledger is not None:
                ledger.unpark()
