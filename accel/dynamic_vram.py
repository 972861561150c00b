"""Dynamic VRAM (ComfyUI 0.33+, on by default on NVIDIA: comfy-aimdo) and the pack's features.

A `ModelPatcherDynamic` keeps its weights in host memory and faults each module's weights into a virtual VRAM
range when the module casts them (`comfy.ops.cast_bias_weight` -> `cast_modules_with_vbar`). Those casts are
ctypes calls into aimdo (`vbar_fault` builds a `ctypes.c_uint32 * n` array), which Dynamo cannot trace: every
comfy op of a compiled block would break its graph, and the pack's background child saves graphs whole
(`fullgraph=True`), which such a block cannot give. So, per feature (docs/dynamic_vram.md says why and what it
costs):

- Compile Model, Compile VAE: leave dynamic VRAM, as core's TorchCompileModel does, through the dynamic patcher's
  own `get_non_dynamic_delegate()` (the model reloaded once as a regular one, kept on the input patcher for the
  next application). A model that cannot leave (no loader to replay: a custom loader) stays dynamic and runs
  eagerly, with one warning naming `--disable-dynamic-vram`; nothing is ever traced under aimdo's casts.
- DeepCache: keeps dynamic VRAM (it compiles nothing; a reused step skips blocks, whose weights are then simply
  not faulted in).
- Swap Weights: leaves it (an in-place swap needs resident parameters), or refuses with the fix named.

On a ComfyUI without dynamic VRAM (0.3.75, a CPU, --disable-dynamic-vram) every function here passes through.
What was decided for a model is kept by a weak reference for its node's status line (compile/status.py).
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

from .cache.recovery import must_propagate

log = logging.getLogger("comfyui_accel")
FLAG = "--disable-dynamic-vram"


@dataclass(frozen=True)
class Placement:
    """Which way a model (or a VAE copy) of the pack's runs: `kept` under dynamic VRAM or not, `eager` when a
    compiling feature could not take it out, and the words its status line adds."""
    kept: bool
    eager: bool
    text: str


_placements: "weakref.WeakKeyDictionary[object, Placement]" = weakref.WeakKeyDictionary()
_warned: set[str] = set()
_lock = threading.Lock()


def is_dynamic(patcher) -> bool:
    """Whether `patcher` is a ModelPatcherDynamic. ComfyUI before dynamic VRAM (0.3.75) has no `is_dynamic`."""
    check = getattr(patcher, "is_dynamic", None)
    return bool(check()) if callable(check) else False


def runs_dynamic(base_model) -> bool:
    """Whether the patcher running `base_model` now is dynamic: what core itself checks before its prefetch path
    (comfy/model_base.py, `prefetch_dynamic_vbars`). ComfyUI sets `current_patcher` in `pre_run`."""
    return is_dynamic(getattr(base_model, "current_patcher", None))


def warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("[Accel] %s", message)


def note(target, placement: Placement) -> None:
    with _lock:
        _placements[target] = placement


def placement_of(target) -> Placement | None:
    try:
        with _lock:
            return _placements.get(target)
    except TypeError:  # not weakly referenceable: nothing was noted for it
        return None


def leave(patcher, feature: str):
    """`(patcher outside dynamic VRAM, None)`, or `(patcher, why)` when it is dynamic and cannot leave (the caller
    says what that means for its feature). A patcher that is not dynamic comes back as it is. Leaving reloads the
    model through the loader ComfyUI recorded (`cached_patcher_init`); `get_non_dynamic_delegate` keeps that copy
    on the input patcher, so applying the feature again (other options, a second node on the same model) reuses
    it instead of loading a third."""
    if not is_dynamic(patcher):
        return patcher, None
    try:
        delegate = getattr(patcher, "get_non_dynamic_delegate", None)
        out = delegate() if callable(delegate) else patcher.clone(disable_dynamic=True)
    except Exception as err:  # no loader to replay (a custom loader), the file gone: the model stays as it was
        if isinstance(err, MemoryError) or must_propagate(err):
            raise  # out of memory, or ComfyUI's Cancel: not the model's to stay dynamic over
        return patcher, f"{type(err).__name__}: {err}"
    if is_dynamic(out):  # a ComfyUI whose delegate stays dynamic: as one that cannot leave
        return patcher, "its non-dynamic copy is still dynamic"
    log.info("[Accel] %s: the model left dynamic VRAM (reloaded as a regular ComfyUI model, as core's "
             "TorchCompileModel does)", feature)
    return out, None


def warn_kept_eager(feature: str, why: str) -> None:
    warn_once(f"{feature}:{why}", f"{feature}: the model runs under dynamic VRAM (comfy-aimdo) and could not be "
              f"reloaded outside it ({why}): it runs eagerly (the output is unaffected). Start ComfyUI with {FLAG}, "
              "or load the model with a core loader, to compile it.")


def left_placement() -> Placement:
    return Placement(kept=False, eager=False, text="dynamic VRAM left: runs as a regular ComfyUI model "
                                                   f"(as with {FLAG})")


def kept_eager_placement(why: str) -> Placement:
    return Placement(kept=True, eager=True,
                     text=f"eager: dynamic VRAM kept (the model could not leave it: {why}); start ComfyUI with "
                          f"{FLAG} to compile it")


def running_dynamic_placement() -> Placement:
    return Placement(kept=True, eager=True,
                     text=f"eager: the model runs under dynamic VRAM (comfy-aimdo), whose weight casts torch.compile "
                          f"cannot trace; start ComfyUI with {FLAG} to compile it")


def warn_running_dynamic(feature: str) -> None:
    warn_once(f"{feature}:running", f"{feature}: the model runs under dynamic VRAM (comfy-aimdo), whose per-op weight "
              f"casts torch.compile cannot trace: it runs eagerly (the output is unaffected). Start ComfyUI with "
              f"{FLAG} to compile it.")


def kept_note(patcher) -> str:
    """The words DeepCache's message adds for a dynamic model it keeps dynamic; empty otherwise."""
    return "; dynamic VRAM kept" if is_dynamic(patcher) else ""
