"""A block kind's calls through Dynamo (`KindEntry.dynamo`): its torch.compile'd entry function, made once, and one
compiled call, which compiles inside the persistent cache's scope when its inputs are new (accel/cache) and says so
to the web UI; with `may_compile` False, Dynamo's `fail_on_recompile` stance refuses new inputs before the block
runs (WOULD_COMPILE). What the kind counts and decides stays on its `KindEntry` (kinds.py); the saved graphs a
child made are precompiled_runner.py's. The module-level helpers are the ones the child (compile/child/) and
the probes share: torch.compile's arguments, Dynamo's and torch's disk-cache counters (the entry function with a
code object of its own is entry_function.py's)."""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import telemetry
from ..cache import COMPILE_CACHE
from ..cache.recovery import compile_in_cache, innermost, must_propagate, root_cause
from .background.skeleton import CaptureError, dump_skeleton
from .cpu_isa import vec_isa_options
from .entry_function import entry_point
from .options import CompileOptions
from .shapes import CompiledCall, call_values, call_variant

if TYPE_CHECKING:
    from .kinds import KindEntry

log = logging.getLogger("comfyui_accel")


# What `run_compiled(..., may_compile=False)` returns when the kind's graphs do not serve the call's inputs: Dynamo
# refused to compile them (torch.compiler.set_stance("fail_on_recompile")) before the block ran, so the caller
# runs the block eagerly on its untouched inputs.
WOULD_COMPILE = object()
REFUSED = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


def dynamo_frames() -> int:
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


def layouts_of(args: tuple, kwargs: dict) -> bytes | None:
    """The call's input layouts as a child replays them (background/skeleton.py); None when they cannot be sent."""
    try:
        return dump_skeleton((args, kwargs))
    except CaptureError:
        return None


class DynamoRunner:
    """The kind's Dynamo path: its compiled entry function and the call through it (the kind's lock held: its
    `run_compiled` takes it)."""

    def __init__(self, entry: KindEntry):
        self.entry = entry
        self._compiled: Callable | None = None  # made at the first compiled call (see `function`)

    def run(self, block, call: CompiledCall, args: tuple, kwargs: dict, may_compile: bool):
        """The kind's call through Dynamo (KindEntry.run_compiled, its lock held, no precompiled function served
        it): compiled, or compiled now and counted, or WOULD_COMPILE (`may_compile` False and no graph serves
        the inputs); a failed compile or first run sets the kind's failure (its compiled path, never the prompt)
        and runs it eagerly."""
        entry = self.entry
        compiled = self.function()  # before the clock starts: its CPU probe is no compile time
        frames = dynamo_frames()
        start = time.perf_counter()
        entry.last_call_warm = False
        try:
            out, seen = self.call(compiled, block, call, may_compile=may_compile)
            if out is WOULD_COMPILE:
                return out
        except KeyboardInterrupt:
            raise
        except Exception as err:  # a failed compile or first run costs this kind its compiled path, not the prompt
            if must_propagate(err) or must_propagate(innermost(err)):
                raise  # out of memory, or ComfyUI's Cancel (it clears its flag as it raises: a rerun would go on)
            entry.fall_back(root_cause(err), err)
            return entry.run_eager(block, args, kwargs, entry.reason)
        new_frames = dynamo_frames() - frames
        if new_frames:
            self._note_compile(new_frames, time.perf_counter() - start, args, kwargs)
        else:
            entry.cache_hits += 1
            entry.last_call_warm = seen
        return out

    def function(self) -> Callable:
        """The kind's torch.compile'd entry point, made when first needed: its options may need the CPU's vector
        instruction probe (cpu_isa.py, seconds), which a kind compiled in the background leaves to the child,
        off the first prompt's path."""
        entry = self.entry
        if self._compiled is None:
            self._compiled = torch.compile(entry_point(entry.forward, entry.name),
                                           **compile_kwargs(entry.options, entry.device_type))
        return self._compiled

    def call(self, compiled: Callable, block, call: CompiledCall, may_compile: bool = True) -> tuple[Any, bool]:
        """One compiled call, and whether its inputs were seen before. Inputs already seen run at once: their
        graph exists, and the dynamic marks only steer a compile (`maybe_mark_dynamic` is a hint no guard
        reads), so a warm call asks nothing more of the kind's shapes. New inputs are marked and may compile, so
        that call runs inside the persistent cache's scope (torch's caches in the pack's directory, the artifacts
        saved); inputs already seen skip the scope's cost, tens of microseconds a call. Should another guard
        still recompile there, the graph is correct and merely not persisted. A call that compiles tells the web
        UI that the prompt waits, and when it stops waiting."""
        entry = self.entry
        call_args, call_kwargs, signature = call.args, call.kwargs, call.signature
        if signature in entry.shapes.seen_inputs:
            return compiled(block, *call_args, **call_kwargs), True
        entry.shapes.mark(call_args, call_kwargs)
        if not may_compile:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):  # this call only: restored on the way out
                    out = compiled(block, *call_args, **call_kwargs)
            except RuntimeError as err:
                if not str(err).startswith(REFUSED):
                    raise
                return WOULD_COMPILE, False
            entry.shapes.seen_inputs.add(signature)  # a graph of the kind serves them: a warm call
            return out, True
        if entry.first_call is None:
            entry.first_call = layouts_of(call_args, call_kwargs)
        entry.shapes.call_variants.add(call_variant(call_args, call_kwargs))
        disk = disk_cache_counters()
        entry.compiling_now = True
        telemetry.record("compile_model", "compiling_now", kind=entry.kind.label)  # the web UI says the prompt waits
        start = time.perf_counter()
        try:
            out = self._compile_and_call(compiled, block, call)
        finally:
            entry.compiling_now = False  # done or failed: either way the prompt no longer waits for this kind
            telemetry.record("compile_model", "compiled_now", kind=entry.kind.label,
                             seconds=round(time.perf_counter() - start, 2))
        entry.disk_cache.update(disk_cache_counters() - disk)
        entry.shapes.seen_inputs.add(signature)
        return out, False

    def _compile_and_call(self, compiled: Callable, block, call: CompiledCall):
        """A call that may compile, inside the persistent cache's scope; what goes wrong in the cache costs the
        persistence at most (cache/recovery.py).

        A block compiled as several graphs runs each as it is made: when a later one fails to compile, the earlier
        ones have run, and may have changed the call's inputs in place (Flux's blocks add into theirs). So the
        inputs are copied first, and put back before the call is made again (outside the cache) and before the
        failure goes on to the eager fallback, which must see the inputs the block was given."""
        entry = self.entry
        call_args, call_kwargs = call.args, call.kwargs
        given = [(v, v.clone()) for v in call_values(call_args, call_kwargs) if isinstance(v, torch.Tensor)]

        def put_back():
            for tensor, copy in given:
                try:
                    tensor.copy_(copy)
                except RuntimeError:  # its elements overlap (an expanded table): no block wrote into it either
                    pass

        def call_again():
            put_back()
            again_args, again_kwargs = call.again()
            entry.shapes.mark(again_args, again_kwargs)
            return compiled(block, *again_args, **again_kwargs)

        try:
            return compile_in_cache(COMPILE_CACHE.environment(entry.device_type), entry.cache_id, entry.name,
                                    entry.kind.label, lambda: compiled(block, *call_args, **call_kwargs), call_again)
        except BaseException:
            put_back()
            raise

    def _note_compile(self, frames: int, seconds: float, args: tuple, kwargs: dict) -> None:
        entry = self.entry
        entry.graph_breaks |= frames > 1
        if entry.compiles:
            entry.recompile_reasons.append(self._last_guard_failure())
        entry.compiles += frames
        entry.compile_seconds += seconds
        shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        log.info("[Accel] compiled %s for input %s in %.1f s%s", entry.kind.label, shapes[0] if shapes else "?",
                 seconds, f" (recompile: {entry.recompile_reasons[-1]})" if entry.compiles > frames else "")

    def _last_guard_failure(self) -> str:
        from torch._dynamo.utils import guard_failures

        entry = self.entry
        for code, reasons in guard_failures.items():
            if getattr(code, "co_name", None) == entry.name and reasons:
                return str(reasons[-1]).split("\n")[0][:300]  # the latest failure, first line
        return "new shape or state"
