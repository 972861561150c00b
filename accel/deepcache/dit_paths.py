"""DeepCache's idea on a transformer (DiT): on a reused step the middle blocks are not run; their cached residual
(output minus input of that span of blocks, per stream: image tokens, and text tokens where the block carries
them) is added instead, and only the first and last blocks run (with live_blocks "first only", the first; config.py).

Hooked through ComfyUI's own per-block replacement, `patches_replace["dit"][("double_block" | "single_block", i)]`,
which the model's block loop calls with the block's inputs and the original block (Flux, Chroma, HunyuanVideo,
Wan, Qwen-Image, SD3's MMDiT, LTX-Video in ComfyUI 0.3.75 and later). A patch is installed on each block of the
span (`set_model_patch_replace` on the node's clone); what it does in a call is decided before the call, in plain
Python, by runtime.py, and read from the call's `SpanCall`, which travels in the call's own transformer_options
(CALL_KEY; the block loops hand them to the patches; ComfyUI deep-copies a patcher's patches on every clone, so
nothing may live in the patch objects):

- full call, features wanted: each span's first block keeps a copy of its inputs (blocks add into their inputs in
  place, as Flux's do), its last block's output minus that copy is the span's residual;
- reused call: the span's first block returns its inputs plus the residual, the other blocks of the span return
  their inputs: no block of the span runs;
- adaptive call (adaptive.py): the first span's first block measures its input, the signal, and decides per cond
  chunk (with signal "first block residual", that input minus the first block's input, which a `HeadBlockPatch`
  on the first block keeps a copy of); if every chunk reuses the call is a reused call, else its spans run and
  capture, and each span's output of the chunks that reuse is replaced by their input plus their residual (what
  those chunks get alone);
- any other call, or a block whose inputs do not match the residual's shapes: the original block runs.

A span never crosses from one block list to the next (Flux joins its image and text tokens between its double
and single blocks): each list gets a span of its own, the first list's after its first `live` blocks, the last
list's before its last `live` blocks, lists between them whole.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import comfy_names
from ..families import DIT_BLOCK_LISTS, DIT_STREAMS
from .adaptive import AdaptiveCall

CALL_KEY = "accel_deepcache_call"  # the call's SpanCall, in the call's own transformer_options

@dataclass(frozen=True)
class Span:
    """Consecutive blocks of one list whose work a reused call replaces by their residual."""
    index: int  # the span's place among the model's spans
    patch_name: str  # "double_block" or "single_block"
    first: int
    last: int  # inclusive

    def blocks(self) -> range:
        return range(self.first, self.last + 1)


def block_lists(diffusion_model) -> tuple[tuple[str, str], ...] | None:
    for cls in type(diffusion_model).__mro__:
        if cls.__name__ in DIT_BLOCK_LISTS:
            lists = DIT_BLOCK_LISTS[cls.__name__]
            if all(isinstance(getattr(diffusion_model, name, None), torch.nn.ModuleList) for name, _ in lists):
                return lists
    return None


BLOCK_LISTS_NAME = ("DiT block lists (Flux, Chroma, HunyuanVideo, WanModel, QwenImageTransformer2DModel, MMDiT, "
                    "LTXVModel)")  # comfy_names.NAMES


def missing_lists(diffusion_model) -> str | None:
    """A class DeepCache knows whose block lists this ComfyUI keeps under other names (warned once), or None."""
    for cls in type(diffusion_model).__mro__:
        lists = DIT_BLOCK_LISTS.get(cls.__name__)
        gone = [name for name, _ in lists or ()
                if not isinstance(getattr(diffusion_model, name, None), torch.nn.ModuleList)]
        if gone:
            comfy_names.warn_missing(BLOCK_LISTS_NAME, f"{cls.__name__} lacks {', '.join(gone)}")
            return (f"ComfyUI {comfy_names.comfyui_version()}'s {cls.__name__} has no block list "
                    f"{', '.join(gone)}, which DeepCache walks")
    return None


def is_dit(diffusion_model) -> bool:
    return block_lists(diffusion_model) is not None


def plan_spans(diffusion_model, live: int, live_end: int | None = None) -> list[Span]:
    """The spans a reused call skips: everything but the first `live` blocks of the first list and the last
    `live_end` (default: `live`) of the last (lists that are left empty get no span)."""
    live_end = live if live_end is None else live_end
    lists = [(len(getattr(diffusion_model, name)), patch) for name, patch in block_lists(diffusion_model)]
    spans = []
    for i, (count, patch) in enumerate(lists):
        first = live if i == 0 else 0
        last = count - 1 - (live_end if i == len(lists) - 1 else 0)
        if first <= last:
            spans.append(Span(len(spans), patch, first, last))
    return spans


def skipped_share(diffusion_model, spans: list[Span]) -> float | None:
    """The share of the model's per-token work the spans hold, by parameter count (a transformer's linear layers
    cost 2 FLOPs per parameter and token; attention's own matmuls are left out of this estimate)."""
    total = sum(p.numel() for p in diffusion_model.parameters())
    if not total:
        return None
    lists = dict(block_lists(diffusion_model))
    by_patch = {patch: getattr(diffusion_model, name) for name, patch in lists.items()}
    skipped = sum(p.numel() for span in spans for i in span.blocks() for p in by_patch[span.patch_name][i].parameters())
    return skipped / total


@dataclass
class SpanCall:
    """What the span patches do in one model call (set by runtime.py before the call, read by the patches)."""
    capture: bool = False  # record each span's residual (a full call, or an adaptive one)
    residuals: dict = field(default_factory=dict)  # span index -> {stream: tensor}: the cached ones, to reuse
    captured: dict = field(default_factory=dict)  # span index -> {stream: tensor}: computed in this call
    reusing: set = field(default_factory=set)  # span indices served from `residuals` in this call
    starts: dict = field(default_factory=dict)  # span index -> {stream: copy of its first block's inputs}
    ran_spans: set = field(default_factory=set)  # span indices whose blocks ran (a fallback on a reused call)
    adaptive: AdaptiveCall | None = None  # adaptive mode: decided per chunk at the first span's first block
    signal: torch.Tensor | None = None  # a captured call's first span input (image tokens): adaptive's reference
    # adaptive: makes `residuals` from the signal once it is measured (until then they name only the spans)
    pending: Callable | None = None
    # adaptive: called once if no chunk reuses, before the blocks run: the run frees what only a reuse would read
    on_all_run: Callable | None = None
    wants_head: bool = False  # signal "first block residual": the first block keeps a copy of its input
    head_input: torch.Tensor | None = None  # that copy (image tokens)

    def signal_of(self, args: dict) -> torch.Tensor | None:
        """The adaptive signal at the first span's first block, from its arguments: its image tokens, or with
        signal "first block residual" what the live blocks before it added to them (None where the first block
        kept no input of that shape: the call then reuses nothing)."""
        x = args.get(DIT_STREAMS[0])
        if not self.wants_head:
            return x
        if x is None or self.head_input is None or self.head_input.shape != x.shape:
            return None
        return x - self.head_input

    def reuses(self, span_index: int) -> bool:
        """Whether the span is served from its cached residual in this call (asked at its first block)."""
        if span_index not in self.residuals:
            return False
        if self.adaptive is not None:
            return all(self.adaptive.reuse or (False,))
        return not self.capture


def split_residuals(residuals: dict, chunks: int) -> list[dict]:
    """A call's residuals, one dict per cond chunk (the batch's equal parts, as the call's cond/uncond order). A
    stream that ends inside the span (None) stays None in every part."""
    parts = [{} for _ in range(chunks)]
    for span, streams in residuals.items():
        for stream, tensor in streams.items():
            pieces = [None] * chunks if tensor is None else tensor.chunk(chunks)
            for i, piece in enumerate(pieces):
                parts[i].setdefault(span, {})[stream] = piece
    return parts


def join_residuals(parts: list[dict]) -> dict:
    return {span: {stream: joined([p[span][stream] for p in parts]) for stream in parts[0][span]}
            for span in parts[0]}


def joined(pieces: list):
    """The chunks' tensors as one batch. Where they are, in order, the whole of the tensor they were split from
    (the residual of one capture, as the run keeps it): that tensor, not a copy, which at video sizes would add
    a feature of hundreds of MB to every reused call. Else a new tensor."""
    if pieces[0] is None:
        return None
    base = pieces[0]._base
    if base is not None and base.is_contiguous() and all(p._base is base and p.is_contiguous() for p in pieces):
        offset = base.storage_offset()
        for piece in pieces:
            if piece.storage_offset() != offset:
                break
            offset += piece.numel()
        else:
            if offset == base.storage_offset() + base.numel() and base.shape[1:] == pieces[0].shape[1:]:
                return base
    return torch.cat(pieces)


class SpanBlockPatch:
    """The replace patch of one block of a span. Outside a DeepCache call (no SpanCall in the call's options, or
    a model whose loop does not pass them) the original block runs."""

    def __init__(self, span: Span, block: int, other=None):
        self.span, self.block = span, block
        self.other = other  # another node's replace patch of this block, which runs as the block does

    def __call__(self, args: dict, extra: dict) -> dict:
        call, span = (args.get("transformer_options") or {}).get(CALL_KEY), self.span
        original = extra["original_block"]
        if self.other is not None:
            block, other = original, self.other
            original = lambda block_args: other(block_args, {**extra, "original_block": block})  # noqa: E731
        if call is None:
            return original(args)
        first, last = self.block == span.first, self.block == span.last
        if first and call.adaptive is not None and call.adaptive.reuse is None:
            signal = call.signal_of(args)  # at the first span's first block; later spans follow its decision
            reuse = call.adaptive.decide(signal)
            if call.pending is not None:
                pending, call.pending = call.pending, None
                if any(reuse):
                    call.residuals = pending(signal)
            if call.on_all_run is not None and not any(reuse):
                on_all_run, call.on_all_run = call.on_all_run, None
                on_all_run()
        if span.index in call.reusing or (first and call.reuses(span.index)):
            # A stream whose residual is None ends inside the span (SD3's last joint block outputs no text): the
            # span's output has None there, as the blocks give it.
            residual = call.residuals[span.index]
            if first:
                if any(r is not None and (k not in args or args[k].shape != r.shape) for k, r in residual.items()):
                    call.ran_spans.add(span.index)  # another shape: this span runs in this call
                    return original(args)
                call.reusing.add(span.index)
                return {k: None if r is None else args[k] + r for k, r in residual.items()}
            # inside the span: the residual was added at its start
            return {k: None if r is None else args[k] for k, r in residual.items()}
        if call.capture and first:
            call.starts[span.index] = {k: v.clone() for k, v in args.items()
                                       if isinstance(v, torch.Tensor) and k in DIT_STREAMS}
            if call.signal is None and DIT_STREAMS[0] in call.starts[span.index]:
                call.signal = call.signal_of(call.starts[span.index])  # from the copy: blocks add in place
                call.head_input = None  # read: no longer held through the blocks
        out = original(args)
        call.ran_spans.add(span.index)
        if call.capture and last and span.index in call.starts:
            start = call.starts.pop(span.index)
            if any(isinstance(v, torch.Tensor) for v in out.values()) and all(
                    v is None or (isinstance(v, torch.Tensor) and k in start and start[k].shape == v.shape)
                    for k, v in out.items()):
                call.captured[span.index] = {k: None if v is None else v - start[k] for k, v in out.items()}
                if call.adaptive is not None and call.adaptive.mixed and span.index in call.residuals:
                    out = splice_reused_chunks(out, start, call.residuals[span.index], call.adaptive.reuse)
        return out


class HeadBlockPatch:
    """The replace patch of the first block, for signal "first block residual": in a call that asks for it
    (SpanCall.wants_head) it keeps a copy of the block's image tokens before the block runs (blocks add into
    their inputs in place). Everything else runs as the block does, with another node's patch of it."""

    def __init__(self, other=None):
        self.other = other

    def __call__(self, args: dict, extra: dict) -> dict:
        call = (args.get("transformer_options") or {}).get(CALL_KEY)
        if call is not None and call.wants_head and isinstance(args.get(DIT_STREAMS[0]), torch.Tensor):
            call.head_input = args[DIT_STREAMS[0]].clone()
        if self.other is not None:
            return self.other(args, extra)
        return extra["original_block"](args)


def head_key(diffusion_model) -> tuple[str, int]:
    """The replace key of the model's first block (its first list's)."""
    return block_lists(diffusion_model)[0][1], 0


def splice_reused_chunks(out: dict, start: dict, residual: dict, reuse: tuple) -> dict:
    """A span's output with the chunks that reuse replaced by their input plus their cached residual: in a call
    where only some chunks reuse, each chunk gets what it would get in a call of its own."""
    spliced = dict(out)
    for k, residual_k in residual.items():
        if residual_k is None or k not in out or out[k] is None or out[k].shape != residual_k.shape:
            continue
        parts = list(out[k].chunk(len(reuse)))
        starts, residuals = start[k].chunk(len(reuse)), residual_k.chunk(len(reuse))
        for i, reused in enumerate(reuse):
            if reused:
                parts[i] = starts[i] + residuals[i]
        spliced[k] = torch.cat(parts)
    return spliced
