"""What of a block kind's call inputs its graphs depend on, and the shapes the kind has met so far.

Dynamo guards on a call's input signature (shapes, layouts, dtypes, devices, scalars, grad mode). With
dynamic="auto" a kind's first input shapes compile static; once another shape is seen, every dimension that
differed is marked dynamic (and stays so), so one more compile covers every later such change. The ways the
model calls a kind apart from shapes (which inputs are tensors or None, their memory layouts) each need graphs of
their own. `KindShapes` keeps that record for one kind, and predicts whether a call would need a new graph.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """What of a call's inputs Dynamo guards on: tensor shapes, strides, dtypes and devices, whether each is an
    inference tensor, scalar values, grad mode. (Strides, not only contiguous or not: a transposed input is
    another graph, Wan's first block gets one; and Dynamo guards every stride, a size-1 dimension's too, so a
    slice of a table whose length follows the image, as Lumina 2's context refiner gets its rope table, is another
    graph at each image size although its shape and contiguity stay. Two such calls under one signature made the
    second one compile in the prompt: the child had made the graph under the first's name. An inference tensor has
    other dispatch keys: the same UNet block got normal hidden states in one prompt and inference ones in another
    of a mixed run, bench/soak.py.)"""
    def describe(value):
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), tuple(value.stride()), value.dtype, value.device, value.is_inference())
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return type(value)

    return (torch.is_grad_enabled(), tuple(describe(a) for a in args),
            tuple((k, describe(v)) for k, v in kwargs.items()))


def call_values(args: tuple, kwargs: dict) -> list:
    """A call's inputs in one list: the positional ones, then the keyword ones in their order. The order the
    tensor indices of `tensor_shapes` and KindShapes' dynamic marks count in."""
    return [*args, *kwargs.values()]


def with_values(args: tuple, kwargs: dict, values: list) -> tuple[tuple, dict]:
    """The call (args, kwargs) with its inputs replaced by `values`, given in `call_values`' order."""
    return tuple(values[:len(args)]), dict(zip(kwargs, values[len(args):]))


def steady_unit_strides(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's inputs, each tensor whose dimensions of size 1 have strides other than a fresh tensor of its
    layout would give them (the extent of the dimensions after each) as a view of the same elements with those
    strides. Such a stride addresses nothing, yet Dynamo guards it: Lumina 2's context refiner gets the first
    caption-length rows of a rope table as long as caption and image together, whose batch and head dimensions
    (both of size 1) carry the table's length, so each image size would be another graph of the same shapes
    (input_signature holds strides), compiled by a child once per size. The view (`as_strided` over the same
    storage and offset) reads and writes exactly the elements the input does."""
    values = call_values(args, kwargs)
    found = [_steady_strides(v) for v in values]
    if not any(found):
        return args, kwargs
    return with_values(args, kwargs, [v.as_strided(v.shape, s, v.storage_offset()) if s else v
                                       for v, s in zip(values, found)])


def _steady_strides(value) -> tuple | None:
    """A tensor's strides with each size-1 dimension's made the extent of the dimensions after it, where that
    changes one; else None."""
    return _steady_of(value.shape, value.stride()) if isinstance(value, torch.Tensor) else None


@functools.lru_cache(maxsize=1024)  # every compiled block call asks: 2.5 us a call where computing took 10 here
def _steady_of(shape: tuple, strides: tuple) -> tuple | None:
    if 1 not in shape or 0 in shape:
        return None
    steady = tuple(max((strides[e] * shape[e] for e in range(d + 1, len(shape)) if shape[e] != 1), default=1)
                   if shape[d] == 1 else strides[d] for d in range(len(shape)))
    return steady if steady != strides else None


class CompiledCall(NamedTuple):
    """One compiled call's inputs, built once where the call is answered (blocks.BlockSite.compiled_call, the
    VAE's coding site): the arguments the graph gets, their `input_signature`, and `again()`, which builds them
    afresh (steady strides, fresh options) for a call made once more after a failed compile."""
    args: tuple
    kwargs: dict
    signature: tuple
    again: Callable[[], tuple[tuple, dict]]


def compiled_call(args: tuple, kwargs: dict, again: Callable[[], tuple[tuple, dict]]) -> CompiledCall:
    """A compiled call of these inputs: their tensors with steady strides (`steady_unit_strides`) and the
    signature of what the graph gets, in one step (a warm compiled block call asks nothing more of this module)."""
    args, kwargs = steady_unit_strides(args, kwargs)
    return CompiledCall(args, kwargs, input_signature(args, kwargs), again)


def tensor_shapes(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a call's tensor inputs, in order: what a kind's timing and its dynamic marks compare."""
    return tuple(tuple(t.shape) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))


def call_variant(args: tuple, kwargs: dict) -> tuple:
    """A call's inputs apart from their sizes: which are tensors (their rank and whether contiguous) or None."""
    def describe(value):
        if isinstance(value, torch.Tensor):
            return (value.dim(), value.is_contiguous())
        return None if value is None else type(value).__name__

    return tuple(describe(v) for v in (*args, *kwargs.values()))


def varying_dims(shapes: tuple, first: tuple) -> set[tuple[int, int]]:
    """(tensor index, dimension) pairs to make dynamic once inputs changed shape: each tensor's batch dimension
    (batch size and cond/uncond batching change between any two prompts), every dimension that differed, and for an
    image or video tensor (4 or more dimensions) all its spatial and frame dimensions together once one of them
    differed (a size change from a square image to a portrait one should not compile again)."""
    dims = {(i, 0) for i, shape in enumerate(shapes) if shape}
    if len(shapes) != len(first):
        return dims  # another set of inputs: the batch dimension of each is all that can be said
    for i, (now, before) in enumerate(zip(shapes, first)):
        if len(now) != len(before):
            continue
        changed = {d for d in range(len(now)) if now[d] != before[d]}
        if len(now) >= 4 and any(d >= 2 for d in changed):
            changed |= set(range(2, len(now)))
        dims |= {(i, d) for d in changed}
    return dims


class KindShapes:
    """The inputs one kind has met: its first call's shapes, the dimensions marked dynamic since, its call
    variants, the input signatures run compiled here and those sent to a background child."""

    def __init__(self, dynamic: str):
        self.dynamic = dynamic  # the kind's option: "auto", "static" or "dynamic"
        self.first_shapes: tuple | None = None
        self.dynamic_dims: set[tuple[int, int]] = set()  # (tensor index, dimension)
        self.call_variants: set[tuple] = set()
        self.seen_inputs: set[tuple] = set()  # input signatures already run compiled (KindEntry._call_compiled)
        # choose="auto" with a background compile: the signatures a child compiled, which this process then loads
        # from the cache at their next call
        self.shapes_sent: set[tuple] = set()

    def mark(self, args: tuple, kwargs: dict) -> None:
        """dynamic="auto": every dimension that ever differed from the first call's is marked dynamic on the
        call's tensors. Which dimensions vary depends on the model: batch and spatial size for a UNet block, the
        token count for a DiT block (a longer prompt, a larger image or more frames), so they are found, not
        assumed."""
        if self.dynamic != "auto":
            return
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        shapes = tuple(tuple(t.shape) for t in tensors)
        if self.first_shapes is None:
            self.first_shapes = shapes
            return
        if shapes != self.first_shapes:
            self.dynamic_dims.update(varying_dims(shapes, self.first_shapes))
        if self.dynamic_dims:
            from torch._dynamo import maybe_mark_dynamic  # a hint: a dim Dynamo must specialise stays static

            for index, dim in self.dynamic_dims:
                if index < len(tensors) and dim < tensors[index].dim():
                    maybe_mark_dynamic(tensors[index], dim)

    def note_served(self, args: tuple, kwargs: dict) -> None:
        """A call served by a precompiled function, noted as a Dynamo call would note it: a later shape the saved
        graphs do not serve, compiled here (choose="always compiled"), then gets the dynamic graph it would have
        had after this call."""
        if self.first_shapes is None and self.dynamic == "auto":
            self.first_shapes = tensor_shapes(args, kwargs)
        self.call_variants.add(call_variant(args, kwargs))

    def would_compile(self, args: tuple, kwargs: dict) -> bool:
        """A compiled call with these inputs would make a new graph here: its input signature was never run
        compiled nor sent to a child, and it is a new call variant, or (dynamic="auto") it changes a dimension
        not yet dynamic, or (dynamic="static") any shape. A prediction from this kind's own marks: should Dynamo
        still recompile on another guard, that call compiles here as before."""
        if self.first_shapes is None or self.dynamic == "dynamic":
            return False
        signature = input_signature(args, kwargs)
        if signature in self.seen_inputs or signature in self.shapes_sent:
            return False
        if call_variant(args, kwargs) not in self.call_variants or self.dynamic == "static":
            return True
        shapes = tensor_shapes(args, kwargs)
        return shapes != self.first_shapes and bool(varying_dims(shapes, self.first_shapes) - self.dynamic_dims)

    def forget(self) -> None:
        """Back to "no shape seen yet", as in a fresh process (precompile only)."""
        self.first_shapes = None
        self.dynamic_dims.clear()
        self.seen_inputs.clear()
