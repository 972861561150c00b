"""Other nodes' object patches inside the diffusion model: the blocks they reach run eagerly.

ComfyUI applies a ModelPatcher's object patches (`add_object_patch(name, obj)`) by setting `obj` in place of the
attribute `name` on the model for the length of a sampling run; ComfyUI after 0.33 also turns `add_patches`'
("config", (cfg,)) patches into object patches of a configurable submodule (`module.with_config(cfg)`). Such an
object may compute otherwise than the module a block's compiled graph was made from while holding the same
parameters (the same block kind), and a graph saved by a child keeps no guard on what the pack cannot serialise.
So a block at or inside a patched path (or under a patched container) runs eagerly for the run, with one warning;
patches outside the diffusion model (`model_sampling`, `manual_cast_dtype`, ...) change no block and are left alone.

The run's patches are read where the run starts (Compile Model's OUTER_SAMPLE wrapper, whose `class_obj` is the
guider and so knows the patcher) and looked up by the model's block calls (APPLY_MODEL's `class_obj` is the
BaseModel, which knows no patcher).
"""
from __future__ import annotations

import contextlib
import logging
import weakref

from .. import comfy_names

log = logging.getLogger("comfyui_accel")
PREFIX = "diffusion_model."
REASON = "another node's object patch of {key}"

# BaseModel -> the diffusion-model paths (without PREFIX) its running sampling run's patcher object-patches
_running: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_warned: set[tuple] = set()


@contextlib.contextmanager
def run_patches(guider):
    """For the length of one sampling run: the run's object patches inside its diffusion model, for `reason`."""
    patcher = comfy_names.attr(guider, "model_patcher", "CFGGuider.model_patcher")
    model = getattr(patcher, "model", None)
    if patcher is None or model is None:
        yield
        return
    patches = comfy_names.attr(patcher, "object_patches", "ModelPatcher.object_patches", {})
    keys = tuple(sorted(k[len(PREFIX):] for k in patches if isinstance(k, str) and k.startswith(PREFIX)))
    had, before = model in _running, _running.get(model)
    _running[model] = keys
    try:
        yield
    finally:
        if had:
            _running[model] = before
        else:
            _running.pop(model, None)


def patched_paths(base_model) -> tuple[str, ...]:
    """The object-patched paths inside `base_model`'s diffusion model in its running sampling run (() if none)."""
    return _running.get(base_model, ())


def reason(site_path: str, paths: tuple[str, ...]) -> str | None:
    """Why the block at `site_path` (relative to the diffusion model; "" for the whole model) runs eagerly: an
    object patch at it, inside it, or of a container holding it; None when no patch reaches it."""
    for path in paths:
        if not site_path or path == site_path or path.startswith(site_path + ".") or site_path.startswith(path + "."):
            return REASON.format(key=PREFIX + path)
    return None


def warn_once(label: str, paths: tuple[str, ...], blocks: int) -> None:
    if not blocks or (label, paths) in _warned:
        return
    _warned.add((label, paths))
    shown = ", ".join(PREFIX + p for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    log.warning("[Accel] Compile Model: other nodes' object patches (%s) replace parts of %d blocks of %s; those "
                "blocks run eagerly (a compiled graph could hold what the patch replaced).", shown, blocks, label)
