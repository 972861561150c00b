"""What a background child compiles, taken during an eager call: one block of a kind (its skeleton, skeleton.py)
and the input layouts of the calls it is to compile for, never the call's tensors or the user's weights."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .skeleton import CaptureError, dump_skeleton


@dataclass
class Capture:
    """One block of a kind and the input layouts of its compiled calls, taken during an eager call: one per
    distinct input signature, in call order (a kind can run at two resolutions in one UNet call; the child
    compiles them in the same order, so it makes the same static-then-dynamic graphs this process would).

    Only layouts are kept (shapes, strides, dtypes), taken when the call is seen: the real call's tensors are
    neither held nor read after the block ran, so a block that changes its inputs in place changes nothing
    here, and nothing here changes the call."""
    entry: Any  # kinds.KindEntry
    block: torch.nn.Module
    attribute: str
    grad: bool
    inference: bool
    calls: list[bytes] = field(default_factory=list)
    signatures: set = field(default_factory=set)
    device: str = ""
    error: str | None = None
    new_shape: bool = False  # a compiled kind's new input shape (its first call's layouts come first)
    save: bool = False  # graphs compiled in this process, for the child to save whole (state.py's SAVE_*)

    @classmethod
    def in_this_call(cls, entry, block: torch.nn.Module, attribute: str, **fields) -> "Capture":
        """A capture of `block`, made during its call: the child compiles under this call's grad and inference
        modes (a graph made for one mode is not the other's)."""
        return cls(entry, block, attribute, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), **fields)

    def add_call(self, signature: tuple, args: tuple, kwargs: dict) -> None:
        if signature in self.signatures or self.error:
            return
        self.signatures.add(signature)
        if not self.device:
            self.device = str(device_of(self.block, args, kwargs))
        try:
            self.calls.append(dump_skeleton((args, kwargs)))
        except CaptureError as err:
            self.error = str(err)

    def job_item(self) -> dict:
        """What the child reads of this capture (child/compile_kind.py); CaptureError when it cannot be sent."""
        if self.error:
            raise CaptureError(self.error)
        entry = self.entry
        return {"kind": [entry.kind.class_name, entry.kind.signature, entry.kind.label],
                "attribute": self.attribute, "options": options_for_the_child(entry.options),
                "device": self.device, "grad": self.grad, "inference": self.inference,
                "dynamic_dims": sorted(entry.shapes.dynamic_dims),
                "block": dump_skeleton(self.block), "calls": self.calls}


def device_of(block: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return next(block.parameters()).device


def options_for_the_child(options) -> dict:
    return {**dataclasses.asdict(options), "choose": "always compiled", "background": False}
