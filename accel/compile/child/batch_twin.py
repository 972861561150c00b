"""A second graph for a kind met at a batch of 1, saved beside its dynamic one.

A dynamic graph cannot serve a batch it was traced at as 1: Dynamo specialises a size of 1 even where the
dimension is marked dynamic (its 0/1 specialisation), so the graph's guard wants a batch of exactly 1. Models run
at cfg 1 (Flux dev, HunyuanVideo, the distilled and Lightning models) call every block at a batch of 1, and a
later batch change then needed another background job, with that kind eager in the prompt meanwhile. torch's
ways around the specialisation (`mark_unbacked`, `backed_size_oblivious`) did not compile these blocks in torch
2.11 (docs/benchmarks/video.md).

So when a child makes a kind's dynamic graph (some dimension changed) from a call at a batch of 1, of a kind first
met at a batch of 1, it also makes the graph for that call at a batch of 2: the call's batch-marked inputs of size 1
repeated to 2, where Dynamo makes the batch a symbol that serves every batch from 2 up. Tensors inside the call's
tuples, lists and dataclasses are repeated too, and marked on their batch (Chroma's and Flux 2's modulation vectors,
slices of one table, so their strides are kept as the model's larger batch has them). An input that stays at a batch
of 1 at every batch (a table broadcast over the batch, such as Wan's rope table `freqs`) is named in families.py
(UNBATCHED_INPUTS) and left as it is. The twin is only ever called where its guards accept the inputs, so a
wrong guess (an input whose size 1 is no batch and is not in the table) costs its compile and nothing else: such
calls fall to the job they needed before.
`ACCEL_DISABLE_BATCH_TWIN=1` (in ComfyUI's environment, which the children inherit) makes no twin: a user who never
changes the batch saves its compile.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
import torch._dynamo

from ...env_settings import env_switch
from ...families import UNBATCHED_INPUTS
from ..shapes import call_values, tensor_shapes, with_values

TWIN_BATCH = 2
SWITCH = "ACCEL_DISABLE_BATCH_TWIN"


def batch_of(args: tuple, kwargs: dict) -> int | None:
    """A call's batch: its first tensor's (the hidden states') first dimension."""
    shapes = tensor_shapes(args, kwargs)
    return shapes[0][0] if shapes and shapes[0] else None




def batch_twin(block, args: tuple, kwargs: dict, dims: set, job_batches: set) -> tuple[tuple, dict] | None:
    """The inputs of `block`'s call at a batch of TWIN_BATCH, or None when it needs no twin: no dimension is marked
    dynamic beyond the batch (a first, static graph), or the kind's calls in this job (`job_batches`, batch_of each;
    the first is the kind's first call, replayed) were not all at a batch of 1. A kind first met at a larger batch
    (cfg 1 after cfg 5) has, or gets with its next change, a dynamic graph for larger batches: a twin would repeat
    it. `dims` are (tensor index, dimension) pairs over the call's tensors in order (*args, *kwargs.values()), as
    shapes.KindShapes marks them. None too where SWITCH turns twins off."""
    if env_switch(SWITCH) is not None:
        return None
    if job_batches != {1} or batch_of(args, kwargs) != 1 or not any(d != 0 for _, d in dims):
        return None
    batch_marked = {index for index, dim in dims if dim == 0}
    values = call_values(args, kwargs)
    kept = unbatched_positions(block, args, kwargs)
    tensor_index = -1  # dims count the call's direct tensors
    for position, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            tensor_index += 1
            if tensor_index in batch_marked and position not in kept and value.dim() and value.shape[0] == 1:
                values[position] = repeated_batch(value, TWIN_BATCH)
        elif position not in kept:
            values[position] = _nested_repeated(value)
    return with_values(args, kwargs, values)


def unbatched_positions(block, args: tuple, kwargs: dict) -> set[int]:
    """Positions in call_values(args, kwargs) of the inputs UNBATCHED_INPUTS names for the block's class."""
    names = set().union(*(UNBATCHED_INPUTS.get(cls.__name__, frozenset()) for cls in type(block).__mro__))
    if not names:
        return set()
    try:  # positional inputs by the forward's parameter names (after self)
        positional = list(inspect.signature(type(block).forward).parameters)[1:1 + len(args)]
    except (TypeError, ValueError):
        positional = []
    call_names = [*positional, *[None] * (len(args) - len(positional)), *kwargs]
    return {position for position, name in enumerate(call_names) if name in names}


def _nested_repeated(value):
    """`value` with each tensor at a batch of 1 inside its tuples, lists and dataclasses repeated to TWIN_BATCH and
    marked on its batch (maybe-dynamic, as the batch of a direct input is): the modulation vectors a double block
    of Chroma or Flux 2 gets as dataclasses in tuples. Anything else (a dict of options, a scalar) as it is."""
    if isinstance(value, torch.Tensor):
        if not value.dim() or value.shape[0] != 1:
            return value
        repeated = repeated_batch(value, TWIN_BATCH)
        torch._dynamo.maybe_mark_dynamic(repeated, 0)
        return repeated
    if isinstance(value, (tuple, list)):
        items = [_nested_repeated(item) for item in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _nested_repeated(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    return value


def repeated_batch(value: torch.Tensor, batch: int) -> torch.Tensor:
    """`value` (a batch of 1) repeated to `batch`, laid out as the model lays out such a batch: its strides kept,
    which is what a larger batch of the same layout has (HunyuanVideo's and Flux's image tokens are a transposed
    view, the batch outermost; Chroma's modulation vectors are slices of one table, a batch apart by the whole
    table). Another layout would be another graph, which the model's calls would not use. Where the batch's
    stride would overlap the rest (a broadcast view), the dimensions keep their order in memory, densely."""
    rest = max((value.stride(d) * value.shape[d] for d in range(1, value.dim())), default=1)
    if value.stride(0) >= rest:
        out = torch.empty_strided((batch, *value.shape[1:]), value.stride(), dtype=value.dtype, device=value.device)
        out.copy_(value.expand(batch, *value.shape[1:]))
        return out
    order = sorted(range(value.dim()), key=lambda d: (-value.stride(d), d))  # outermost in memory first
    dense = value.permute(order).contiguous()
    repeats = [batch if d == 0 else 1 for d in order]
    return dense.repeat(*repeats).permute([order.index(d) for d in range(value.dim())])
