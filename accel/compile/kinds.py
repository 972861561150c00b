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
"""
from __future__ import annotations

import logging
import threading
import time
import types
from collections import Counter
from typing import Any, Callable

import torch

from .. import telemetry
from ..cache import COMPILE_CACHE
from ..cache.recovery import compile_in_cache, innermost, must_propagate, root_cause
from ..cache.store import key_id
from .background import KindBackground
from .background.cpu_checks import CPU_CHECKS
from .background.skeleton import CaptureError, dump_skeleton
from .blocks import BlockKind
from .cpu_isa import vec_isa_options
from .cuda_graphs import kind_stats
from .kind_choice import KindChoice
from .options import CompileOptions
from .precompiled import NO_GRAPH, PrecompiledGraphs, context_of
from .shapes import KindShapes, call_values, call_variant, input_signature

log = logging.getLogger("comfyui_accel")


def device_signature(device: torch.device) -> tuple:
    if device.type == "cuda":
        return ("cuda", torch.cuda.get_device_capability(device))
    return (device.type, None)


def entry_point(forward: Callable, name: str) -> Callable:
    """A function that calls `forward(block, ...)`, with a code object of its own named `name` (child/ saves it)."""
    def block_entry(block, *args, **kwargs):
        return forward(block, *args, **kwargs)

    code = block_entry.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, block_entry.__globals__, name, None, block_entry.__closure__)


def wait_for_device(device_type: str) -> None:
    """CUDA runs kernels asynchronously: a timing must wait for them, or it measures only their launch."""
    if device_type == "cuda":
        torch.cuda.synchronize()


# What `run_compiled(..., may_compile=False)` returns when the kind's graphs do not serve the call's inputs: Dynamo
# refused to compile them (torch.compiler.set_stance("fail_on_recompile")) before the block ran, so the caller
# runs the block eagerly on its untouched inputs.
WOULD_COMPILE = object()
_REFUSED = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


def _dynamo_frames() -> int:
    from torch._dynamo.utils import counters  # lazily: importing the pack must not pull in Dynamo

    return counters["frames"]["ok"]


# torch's own counters of its on-disk caches: a compile that hits them costs tracing, not code generation.
DISK_CACHE_COUNTERS = {"fx_graph_hits": ("inductor", "fxgraph_cache_hit"),
                       "fx_graph_misses": ("inductor", "fxgraph_cache_miss"),
                       "aot_autograd_hits": ("aot_autograd", "autograd_cache_hit"),
                       "aot_autograd_misses": ("aot_autograd", "autograd_cache_miss")}


def disk_cache_counters() -> Counter[str]:
    from torch._dynamo.utils import counters

    return Counter({name: counters[group][key] for name, (group, key) in DISK_CACHE_COUNTERS.items()})


def compile_kwargs(options: CompileOptions, device_type: str) -> dict:
    """torch.compile's arguments for one kind: the user's options, plus inductor options of the pack's own that
    apply to this compile only (torch.compile takes a mode or options, so a mode becomes its options)."""
    kwargs = options.torch_compile_kwargs(device_type)
    extra = {}
    if device_type == "cpu" and options.backend == "inductor":
        env = COMPILE_CACHE.environment("cpu")
        if env.check_usable():
            extra = vec_isa_options(env.dir)
    if extra:
        from torch._inductor import list_mode_options

        mode = kwargs.pop("mode", None)
        kwargs["options"] = {**(list_mode_options(mode, kwargs.get("dynamic")) if mode else {}),
                             **kwargs.get("options", {}), **extra}
    return kwargs


def _layouts_of(args: tuple, kwargs: dict) -> bytes | None:
    """The call's input layouts as a child replays them (background/skeleton.py); None when they cannot be sent."""
    try:
        return dump_skeleton((args, kwargs))
    except CaptureError:
        return None


class KindEntry:
    """One block kind: its lazily compiled entry point and its statistics."""

    def __init__(self, key: tuple, kind: BlockKind, forward: Callable, options: CompileOptions, device_type: str):
        self.key = key
        self.kind = kind
        self.options = options
        self.name = f"accel_{kind.class_name.replace('.', '_')}_{kind.signature}"
        self._compiled: Callable | None = None  # made at the first compiled call (see `compiled`)
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
        self._calls = threading.RLock()

    def compiled_entry(self) -> Callable:
        """The kind's torch.compile'd entry point, made when first needed: its options may need the CPU's vector
        instruction probe (cpu_isa.py, seconds), which a kind compiled in the background leaves to the child,
        off the first prompt's path."""
        if self._compiled is None:
            self._compiled = torch.compile(entry_point(self.forward, self.name),
                                           **compile_kwargs(self.options, self.device_type))
        return self._compiled

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

    def run_compiled(self, block, make_call: Callable[[], tuple[tuple, dict]], args: tuple, kwargs: dict,
                     may_compile: bool = True):
        """Run `block` compiled. `make_call` builds fresh (args, kwargs) for the compiled call; `args`/`kwargs`
        are the caller's own, for the eager path a failed compile falls back to. With `may_compile` False (only
        where `can_refuse_compiles`), inputs no graph of the kind serves return WOULD_COMPILE, the block not run."""
        with self._calls:
            return self._run_compiled(block, make_call, args, kwargs, may_compile)

    def _run_compiled(self, block, make_call: Callable[[], tuple[tuple, dict]], args: tuple, kwargs: dict,
                      may_compile: bool = True):
        if self.failure:
            return self.run_eager(block, args, kwargs, self.reason)
        self.last_call_warm = False
        out = self._call_precompiled(block, make_call, may_load=may_compile)
        if out is not NO_GRAPH:
            return out
        if not may_compile and self.compiles == 0:  # no Dynamo graph either: it would compile
            return WOULD_COMPILE
        compiled = self.compiled_entry()  # before the clock starts: its CPU probe is no compile time
        frames = _dynamo_frames()
        start = time.perf_counter()
        self.last_call_warm = False
        try:
            out, seen = self._call_compiled(compiled, block, make_call, may_compile=may_compile)
            if out is WOULD_COMPILE:
                return out
        except KeyboardInterrupt:
            raise
        except Exception as err:  # a failed compile or first run costs this kind its compiled path, not the prompt
            if must_propagate(err) or must_propagate(innermost(err)):
                raise  # out of memory, or ComfyUI's Cancel (it clears its flag as it raises: a rerun would go on)
            self._fall_back(root_cause(err), err)
            return self.run_eager(block, args, kwargs, self.reason)
        new_frames = _dynamo_frames() - frames
        if new_frames:
            self._note_compile(new_frames, time.perf_counter() - start, args, kwargs)
        else:
            self.cache_hits += 1
            self.last_call_warm = seen
        return out

    def load_precompiled(self) -> bool:
        """Load the kind's due precompiled functions (precompiled.py) now: at an idle moment (background/loader.py)
        or at its next call, whichever comes first. False when they cannot load yet: on the CPU before inductor's
        per-process checks ran (loading would run them here: seconds)."""
        with self._calls:
            graphs = self.precompiled
            if not graphs.due:
                return True
            if self.device_type == "cpu" and not CPU_CHECKS.done:
                return False
            loaded = len(graphs.loaded_names)
            env = COMPILE_CACHE.environment(self.device_type)
            with env.loading():
                graphs.load_due(lambda: env.precompiled_files(self.cache_id), env.inductor_dir)
            if len(graphs.loaded_names) != loaded:
                log.info("[Accel] Compile Model: %s loaded %d precompiled graphs (%.2f s in all so far)",
                         self.kind.label, len(graphs.loaded_names) - loaded, graphs.load_seconds)
            return True

    def _call_precompiled(self, block, make_call: Callable[[], tuple[tuple, dict]], may_load: bool):
        """The call served by a precompiled function of the kind; NO_GRAPH when none accepts the inputs. With
        `may_load` (a call that may compile anyway) it loads those still due first; without, they load between
        prompts (background/loader.py) and inputs only they would serve get NO_GRAPH meanwhile."""
        graphs = self.precompiled
        loads_now = may_load and graphs.due and self.load_precompiled() and not graphs.due
        if not graphs.functions:
            return NO_GRAPH
        return self._serve_precompiled(block, make_call, warm=not loads_now)  # a call that loaded: no fair timing

    def _serve_precompiled(self, block, make_call, warm: bool):
        call_args, call_kwargs = make_call()
        # what a child compiling a new shape of the kind replays first: taken before the block may change them
        layouts = _layouts_of(call_args, call_kwargs) if self.first_call is None else None
        out = self.precompiled.call(context_of(block, self.forward, call_args, call_kwargs), block, call_args,
                                    call_kwargs, self.kind.label)
        if out is NO_GRAPH:
            return out
        self.first_call = self.first_call or layouts
        self.shapes.note_served(call_args, call_kwargs)
        self.cache_hits += 1
        self.last_call_warm = warm  # a call that loaded is no fair timing
        return out

    @property
    def reason(self) -> str:
        return self.failure or self.choice.reason

    def _call_compiled(self, compiled: Callable, block, make_call: Callable[[], tuple[tuple, dict]],
                       may_compile: bool = True) -> tuple[Any, bool]:
        """One compiled call, and whether its inputs were seen before. New inputs may compile, so that call runs
        inside the persistent cache's scope (torch's caches in the pack's directory, the artifacts saved); inputs
        already seen skip the scope's cost, tens of microseconds a call. Should another guard still recompile
        there, the graph is correct and merely not persisted. A call that compiles tells the web UI that the prompt
        waits, and when it stops waiting."""
        call_args, call_kwargs = make_call()
        self.shapes.mark(call_args, call_kwargs)
        signature = input_signature(call_args, call_kwargs)
        if signature in self.shapes.seen_inputs:
            return compiled(block, *call_args, **call_kwargs), True
        if not may_compile:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):  # this call only: restored on the way out
                    out = compiled(block, *call_args, **call_kwargs)
            except RuntimeError as err:
                if not str(err).startswith(_REFUSED):
                    raise
                return WOULD_COMPILE, False
            self.shapes.seen_inputs.add(signature)  # a graph of the kind serves them: a warm call
            return out, True
        if self.first_call is None:
            self.first_call = _layouts_of(call_args, call_kwargs)
        self.shapes.call_variants.add(call_variant(call_args, call_kwargs))
        disk = disk_cache_counters()
        self.compiling_now = True
        telemetry.record("compile_model", "compiling_now", kind=self.kind.label)  # the web UI says the prompt waits
        start = time.perf_counter()
        try:
            out = self._compile_and_call(compiled, block, make_call, call_args, call_kwargs)
        finally:
            self.compiling_now = False  # done or failed: either way the prompt no longer waits for this kind
            telemetry.record("compile_model", "compiled_now", kind=self.kind.label,
                             seconds=round(time.perf_counter() - start, 2))
        self.disk_cache.update(disk_cache_counters() - disk)
        self.shapes.seen_inputs.add(signature)
        return out, False

    def _compile_and_call(self, compiled: Callable, block, make_call: Callable[[], tuple[tuple, dict]],
                          call_args: tuple, call_kwargs: dict):
        """A call that may compile, inside the persistent cache's scope; what goes wrong in the cache costs the
        persistence at most (cache/recovery.py).

        A block compiled as several graphs runs each as it is made: when a later one fails to compile, the earlier
        ones have run, and may have changed the call's inputs in place (Flux's blocks add into theirs). So the
        inputs are copied first, and put back before the call is made again (outside the cache) and before the
        failure goes on to the eager fallback, which must see the inputs the block was given."""
        given = [(v, v.clone()) for v in call_values(call_args, call_kwargs) if isinstance(v, torch.Tensor)]

        def put_back():
            for tensor, copy in given:
                try:
                    tensor.copy_(copy)
                except RuntimeError:  # its elements overlap (an expanded table): no block wrote into it either
                    pass

        def call_again():
            put_back()
            again_args, again_kwargs = make_call()
            self.shapes.mark(again_args, again_kwargs)
            return compiled(block, *again_args, **again_kwargs)

        try:
            return compile_in_cache(COMPILE_CACHE.environment(self.device_type), self.cache_id, self.name,
                                    self.kind.label, lambda: compiled(block, *call_args, **call_kwargs), call_again)
        except BaseException:
            put_back()
            raise

    # -- bookkeeping -----------------------------------------------------------------------------
    def _note_compile(self, frames: int, seconds: float, args: tuple, kwargs: dict) -> None:
        self.graph_breaks |= frames > 1
        if self.compiles:
            self.recompile_reasons.append(self._last_guard_failure())
        self.compiles += frames
        self.compile_seconds += seconds
        shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        log.info("[Accel] compiled %s for input %s in %.1f s%s", self.kind.label, shapes[0] if shapes else "?",
                 seconds, f" (recompile: {self.recompile_reasons[-1]})" if self.compiles > frames else "")

    def _last_guard_failure(self) -> str:
        from torch._dynamo.utils import guard_failures

        for code, reasons in guard_failures.items():
            if getattr(code, "co_name", None) == self.name and reasons:
                return str(reasons[-1]).split("\n")[0][:300]  # the latest failure, first line
        return "new shape or state"

    def _fall_back(self, why: str, err: Exception | None = None) -> None:
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
