"""One block kind's compiled entry point: compile, run compiled or eager, and count what happened.

Each kind gets its own entry function with its own code object: Dynamo keeps its compiled-code cache and its
automatic-dynamic-shape state per code object, so kinds never evict each other or share a recompile limit.
Every compiled call with inputs not seen before runs inside the persistent compile cache's scope (accel/cache):
torch's on-disk caches live in the pack's directory for that call, and what it compiles is saved as the kind's
portable artifacts.

What auto mode decided for the kind lives in its `choice` (kind_choice.py), where it stands with the background
compiler in its `background` (background/state.py, decided by background/decision.py), the inputs it has met in
its `shapes` (shapes.py); what a failure of the persistent cache costs is cache/recovery.py's. This module only
runs what it is told to.

Its two compiled paths are runners of their own, each given the entry: `dynamo` (dynamo_runner.py: the
torch.compile'd entry function and a call through it, with the helpers the child and the probes share) and
`precompiled_calls` (precompiled_runner.py: the graphs a child saved whole, loaded and served).
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable

import torch

from ..cache.store import key_id
from .background import KindBackground
from .blocks import BlockKind
from .cuda_graphs import kind_stats
from .dynamo_runner import WOULD_COMPILE, DynamoRunner
from .kind_choice import KindChoice
from .options import CompileOptions
from .precompiled import NO_GRAPH, PrecompiledGraphs
from .precompiled_runner import PrecompiledRunner
from .shapes import CompiledCall, KindShapes

log = logging.getLogger("comfyui_accel")


def device_signature(device: torch.device) -> tuple:
    if device.type == "cuda":
        return ("cuda", torch.cuda.get_device_capability(device))
    return (device.type, None)


def wait_for_device(device_type: str) -> None:
    """CUDA runs kernels asynchronously: a timing must wait for them, or it measures only their launch."""
    if device_type == "cuda":
        torch.cuda.synchronize()


class KindEntry:
    """One block kind: what it is, how its calls run (eager, through its runners), its failure and its statistics."""

    def __init__(self, key: tuple, kind: BlockKind, forward: Callable, options: CompileOptions, device_type: str):
        self.key = key
        self.kind = kind
        self.options = options
        self.name = f"accel_{kind.class_name.replace('.', '_')}_{kind.signature}"
        self.forward = forward
        self.device_type = device_type
        self.cache_id = key_id(key)  # its name in the persistent compile cache
        self.failure: str | None = None  # set when compiling or a first compiled run failed: eager for good
        # the type of what raised then (a child tells a graph break apart by it); not the exception itself, whose
        # traceback would hold the failed call's tensors for the process's life
        self.failed_with: type[BaseException] | None = None
        self.compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0
        self.last_call_warm = False  # the latest compiled call neither compiled nor met new inputs (a fair timing)
        self.disk_cache: Counter[str] = Counter()  # torch's on-disk cache hits and misses while compiling
        self.eager_calls: Counter[str] = Counter()
        self.recompile_reasons: list[str] = []
        self.shapes = KindShapes(options.dynamic)  # the inputs met, the dimensions marked dynamic (shapes.py)
        self.compiling_now = False  # a call of new inputs compiles (or loads) in the prompt's path (status.py)
        self.graph_breaks = False  # a compile here made more than one frame: its block runs as several graphs
        # choose="auto" with a background compile: the first compiled call's input layouts (a child compiling a
        # new shape replays it first, so it makes the same static-then-dynamic graphs this process would)
        self.first_call: bytes | None = None
        self.choice = KindChoice(kind.label, key_id(key[:4]), device_type)  # choose="auto" (kind_choice.py)
        self.background = KindBackground(kind.label)  # choose="auto" with a background compile (background/)
        # the graphs a child saved whole (precompiled.py): served without Dynamo, loaded in milliseconds
        self.precompiled = PrecompiledGraphs()
        # Compiled calls run in the sampler's thread, and a compile-worker's own calls in its: one at a time, so a
        # kind is never compiled twice at once (uncontended: ~0.1 us a call).
        self.call_lock = threading.RLock()
        self.dynamo = DynamoRunner(self)  # its calls through Dynamo (dynamo_runner.py)
        self.precompiled_calls = PrecompiledRunner(self)  # its calls served by saved graphs (precompiled_runner.py)

    @property
    def path(self) -> str:
        """The path its blocks take in auto mode now."""
        if self.failure or self.background.waiting:
            return "eager"
        return self.choice.path or "compiled"

    @property
    def can_refuse_compiles(self) -> bool:
        """Whether a call may ask Dynamo for this kind's existing graphs or nothing (`may_compile=False`): once the
        kind has graphs here, each one frame. Dynamo's own guards then decide what a graph serves, where
        `would_compile` only predicts it (a batch of 1 is a graph of its own: Dynamo specialises sizes 0 and 1).
        A kind with graph breaks could be refused at its second frame, after the first had changed the block's
        inputs in place, so it keeps the prediction."""
        if torch.compiler.is_compiling():
            return False
        return (self.compiles > 0 and not self.graph_breaks) or self.precompiled.expected

    @property
    def ran_compiled(self) -> bool:
        """A call of the kind ran compiled: through Dynamo, or served by a precompiled function."""
        return bool(self.shapes.seen_inputs) or self.precompiled.calls > 0

    @property
    def loads_between_prompts(self) -> bool:
        """The kind's precompiled graphs are due and none is loaded yet: with the background compile its blocks run
        eagerly until they load at an idle moment (background/loader.py; on the CPU once inductor's checks ran),
        since loading in a prompt costs about 0.1 s a kind, 3x a 50 ms prompt."""
        return self.precompiled.due and self.compiles == 0 and not self.precompiled.functions

    # -- calls -----------------------------------------------------------------------------------
    def run_eager(self, block, args: tuple, kwargs: dict, reason: str):
        self.eager_calls[reason] += 1
        return self.forward(block, *args, **kwargs)

    def run_compiled(self, block, call: CompiledCall, args: tuple, kwargs: dict, may_compile: bool = True):
        """Run `block` compiled. `call` (shapes.CompiledCall) is the compiled call's inputs, built where the call
        was answered; `args`/`kwargs` are the caller's own, for the eager path a failed compile falls back to.
        With `may_compile` False (only where `can_refuse_compiles`), inputs no graph of the kind serves return
        WOULD_COMPILE, the block not run."""
        with self.call_lock:
            return self._run_compiled(block, call, args, kwargs, may_compile)

    def _run_compiled(self, block, call: CompiledCall, args: tuple, kwargs: dict, may_compile: bool = True):
        if self.failure:
            return self.run_eager(block, args, kwargs, self.reason)
        self.last_call_warm = False
        graphs = self.precompiled
        if may_compile and not graphs.looked_up and self.compiles == 0:  # a first compile here: saved whole before?
            self.precompiled_calls.look_up_before_a_compile()
        if graphs.due or graphs.functions:  # else its runner would find none: the Dynamo path at once
            out = self.precompiled_calls.call(block, call, may_load=may_compile)
            if out is not NO_GRAPH:
                return out
        if not may_compile and self.compiles == 0:  # no Dynamo graph either: it would compile
            return WOULD_COMPILE
        return self.dynamo.run(block, call, args, kwargs, may_compile)

    def load_precompiled(self) -> bool:
        """Load the kind's due precompiled functions now (background/loader.py at an idle moment, or its next
        call); False when they cannot load yet (precompiled_runner.py)."""
        return self.precompiled_calls.load()

    @property
    def reason(self) -> str:
        return self.failure or self.choice.reason

    # -- failure and stats -----------------------------------------------------------------------------
    def fall_back(self, why: str, err: Exception | None = None) -> None:
        self.failure = f"compile failed: {why}"
        self.failed_with = type(err) if err is not None else None
        log.warning("[Accel] Compile Model: %s runs eagerly because compiling it failed (%s). The output is "
                    "unaffected; ACCEL_DISABLE_COMPILE=1 skips compiling altogether.", self.kind.label, why)

    def stats(self) -> dict[str, Any]:
        choice = self.choice
        return {
            "kind": self.kind.label, "entry": self.name, "path": self.path, "timed": choice.decided,
            "reason": self.reason or ("" if choice.decided else choice.progress()),
            "compiles": self.compiles, "recompiles": max(0, self.compiles - 1) if self.compiles else 0,
            "recompile_reasons": list(self.recompile_reasons), "compile_seconds": round(self.compile_seconds, 3),
            "cache_hits": self.cache_hits, "disk_cache": dict(self.disk_cache),
            "eager_calls": dict(self.eager_calls), "timings": dict(choice.timings),
            "call_share": round(choice.share, 4) if choice.share is not None else None,
            "dynamic_dims": sorted(self.shapes.dynamic_dims), "call_variants": len(self.shapes.call_variants),
            "dropped_samples": dict(choice.dropped.by_work), "rechecks": choice.rechecks,
            "background": self.background.stats(), "precompiled": self.precompiled.stats(),
            "cuda_graphs": kind_stats(self),
        }
