"""Block skeletons: a block's module structure and tensor layouts, with no tensor data, for the child process.

Weights are graph inputs, so their values do not change the compiled code: the child builds uninitialised
tensors of the same shape, strides, dtype and device, and compiles the same graphs this process would.
"""
from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

import torch

MAX_SKELETON_BYTES = 64 * 2**20  # a block's skeleton is kilobytes; more means it drags in something it should not
# This module is `<pack>.accel.compile.background.skeleton` inside ComfyUI and `accel.compile...` in the child.
_PACK_PREFIX = __name__[: -len("compile.background.skeleton")]


class CaptureError(ValueError):
    """A block or its inputs cannot be sent to the child process."""


class _SkeletonPickler(pickle.Pickler):
    def reducer_override(self, obj):
        # An object of the pack's that stands in a block's attribute while ComfyUI has it patched in (Compile VAE's
        # `decode`) goes to the child as what it stands for: the child compiles ComfyUI's own method, and a
        # precompiled function saved there must not name the pack's classes (the child imports the pack as
        # `accel`, ComfyUI under its custom_nodes folder's name: such a file would not load in the server).
        stand_in = getattr(type(obj), "skeleton_stand_in", None)
        return stand_in(obj) if stand_in is not None else NotImplemented

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter):
                raise CaptureError(f"a tensor of type {type(obj).__name__} (only plain tensors are captured)")
            return ("tensor", tuple(obj.shape), tuple(obj.stride()), str(obj.dtype).removeprefix("torch."),
                    str(obj.device), isinstance(obj, torch.nn.Parameter), obj.requires_grad, obj.is_inference())
        module = getattr(obj, "__module__", None)
        if isinstance(module, str) and module.startswith(_PACK_PREFIX) and hasattr(obj, "__qualname__"):
            # the pack's own functions (the SDPA override in a block's options) by name, whatever the pack's
            # module is called in this process
            return ("pack", module[len(_PACK_PREFIX):], obj.__qualname__)
        return None


class _SkeletonUnpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        if pid[0] == "pack":
            target = importlib.import_module(_PACK_PREFIX + pid[1])
            for name in pid[2].split("."):
                target = getattr(target, name)
            return target
        _, shape, stride, dtype, device, is_param, requires_grad, inference = pid
        # Inference tensors are made, and made parameters, in inference mode, as ComfyUI's executor makes a
        # VAE's: outside it, torch refuses requires_grad on an inference tensor.
        with torch.inference_mode(inference):
            # Same layout, values never written: they do not reach the compiled code, and large allocations are
            # fresh pages that reading leaves unallocated (the kernel's shared zero page), so the child's memory
            # holds little of the blocks' weights. Not a view of a larger tensor: a view would have a _base.
            tensor = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
            if is_param:
                return torch.nn.Parameter(tensor, requires_grad=requires_grad)
            return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def dump_skeleton(obj: Any) -> bytes:
    buffer = io.BytesIO()
    try:
        _SkeletonPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except CaptureError:
        raise
    except Exception as err:  # pickle's errors vary (PicklingError, TypeError, AttributeError)
        raise CaptureError(f"{type(err).__name__}: {str(err)[:200]}") from err
    if buffer.tell() > MAX_SKELETON_BYTES:
        raise CaptureError(f"its skeleton is {buffer.tell() >> 20} MiB, more than a block should hold")
    return buffer.getvalue()


def load_skeleton(data: bytes) -> Any:
    return _SkeletonUnpickler(io.BytesIO(data)).load()
