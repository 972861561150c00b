"""A block kind's entry function: the function torch.compile traces for the kind, with a code object of its own.

Dynamo keeps its compiled-code cache and its automatic-dynamic-shape state per code object, so each kind gets
its own (named after the kind): kinds never evict each other or share a recompile limit. The child saves it
whole under that name (child/compile_kind.py). It is its own module because a warm compiled call enters it from
torch's frames: the walk of a call (tools/call_walk.py) then counts it apart from the runner that calls it.
"""
from __future__ import annotations

import types
from typing import Callable


def entry_point(forward: Callable, name: str) -> Callable:
    """A function that calls `forward(block, ...)`, with a code object of its own named `name`."""
    def block_entry(block, *args, **kwargs):
        return forward(block, *args, **kwargs)

    code = block_entry.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, block_entry.__globals__, name, None, block_entry.__closure__)
