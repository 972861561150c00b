"""A second graph for a kind met at a batch of 1, saved beside its dynamic one.

A dynamic graph cannot serve a batch it was traced at as 1: Dynamo specialises a size of 1 even where the
dimension is marked dynamic (its 0/1 specialisation), so the graph's guard wants a batch of exactly 1. Models run
at cfg 1 (Flux dev, HunyuanVideo, the distilled and Lightning models) call every block at a batch of 1, and a
later batch change then needed another background job, with that kind eager in the prompt meanwhile. torch's
ways around the specialisation (`mark_unbacked`, `backed_size_oblivious`) did not compile these blocks in torch
2.11 (docs/benchmarks/video.md).

So when a child makes a kind's dynamic graph (some dimension changed) from a call at a batch of 1, of a kind first
met at a batch of 1, it also makes the graph for that call at a batch of 2: the call's batch-marked inputs of size 1
repeated to 2, where Dynamo makes the batch a symbol that serves every batch from 2 up. The twin is only ever called
where its guards accept the inputs, so a wrong guess (an input whose size 1 is no batch, such as a broadcast table:
Wan's rope table `freqs` is at a batch of 1 at every batch) costs its compile and nothing else: such calls fall to
the job they needed before. Only tensors passed directly are repeated: a batch inside a tuple (Chroma's modulation
vectors) stays 1, so that twin is refused and a batch change there costs a job, as before.
`ACCEL_DISABLE_BATCH_TWIN=1` (in ComfyUI's environment, which the children inherit) makes no twin: a user who never
changes the batch saves its compile.
"""
from __future__ import annotations

import os

import torch

from ..shapes import call_values, tensor_shapes, with_values

TWIN_BATCH = 2
SWITCH = "ACCEL_DISABLE_BATCH_TWIN"


def batch_of(args: tuple, kwargs: dict) -> int | None:
    """A call's batch: its first tensor's (the hidden states') first dimension."""
    shapes = tensor_shapes(args, kwargs)
    return shapes[0][0] if shapes and shapes[0] else None


def batch_twin(args: tuple, kwargs: dict, dims: set, job_batches: set) -> tuple[tuple, dict] | None:
    """The call's inputs at a batch of TWIN_BATCH, or None when it needs no twin: no dimension is marked dynamic
    beyond the batch (a first, static graph), or the kind's calls in this job (`job_batches`, batch_of each; the
    first is the kind's first call, replayed) were not all at a batch of 1. A kind first met at a larger batch
    (cfg 1 after cfg 5) has, or gets with its next change, a dynamic graph for larger batches: a twin would repeat
    it. `dims` are (tensor index, dimension) pairs over the call's tensors in order (*args, *kwargs.values()), as
    shapes.KindShapes marks them. None too where SWITCH turns twins off."""
    if os.environ.get(SWITCH, "") not in ("", "0"):
        return None
    if job_batches != {1} or batch_of(args, kwargs) != 1 or not any(d != 0 for _, d in dims):
        return None
    batch_marked = {index for index, dim in dims if dim == 0}
    values = call_values(args, kwargs)
    tensor_at = [i for i, value in enumerate(values) if isinstance(value, torch.Tensor)]  # dims' indices to values
    for index in batch_marked & set(range(len(tensor_at))):
        value = values[tensor_at[index]]
        if value.dim() and value.shape[0] == 1:
            values[tensor_at[index]] = repeated_batch(value, TWIN_BATCH)
    return with_values(args, kwargs, values)


def repeated_batch(value: torch.Tensor, batch: int) -> torch.Tensor:
    """`value` (a batch of 1) repeated to `batch`, laid out as the model lays out such a batch: its dimensions in
    the same order in memory (HunyuanVideo's and Flux's image tokens are a transposed view, the batch outermost).
    Another layout would be another graph, which the model's calls would not use."""
    order = sorted(range(value.dim()), key=lambda d: (-value.stride(d), d))  # outermost in memory first
    dense = value.permute(order).contiguous()
    repeats = [batch if d == 0 else 1 for d in order]
    return dense.repeat(*repeats).permute([order.index(d) for d in range(value.dim())])
