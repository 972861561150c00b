"""Process-wide registry of compiled block kinds: one compiled entry point per kind, shared by every model.

The key is what determines the compiled code: the block's class and parameter signature, the device kind and
capability, torch's version and the compile options. ModelPatcher clones, re-executions of the node and a
second model of the same architecture therefore find the same entry and compile nothing new; the weights are
graph inputs, never baked in.

Each kind gets its own entry function with its own code object: Dynamo keeps its compiled-code cache and its
automatic-dynamic-shape state per code object, so kinds never evict each other or share a recompile limit.

Every compiled call runs inside the persistent compile cache's scope (accel/cache): torch's on-disk caches live in
the pack's directory for that call, and what it compiles is saved as the kind's portable artifacts.
"""
from __future__ import annotations

import logging
import threading
import time
import types
from collections import Counter
from typing import Any, Callable

import torch

from ..cache import COMPILE_CACHE
from ..cache.store import key_id
from .background import BACKGROUND
from .blocks import BlockKind
from .cpu_isa import vec_isa_options
from .options import CompileOptions
from .saved_shares import saved_share

log = logging.getLogger("comfyui_accel")
TIMING_REPEATS = 3
# Keep compiled only when it is faster by this margin, so timing noise cannot make us slower than eager.
FASTER_MARGIN = 0.98
# choose="auto" compiles a kind only if its blocks take at least this share of a UNet call when run eagerly:
# compiling a kind costs about as much whatever its share, and can save at most its share of the call.
MIN_CALL_SHARE = 0.04


def device_signature(device: torch.device) -> tuple:
    if device.type == "cuda":
        return ("cuda", torch.cuda.get_device_capability(device))
    return (device.type, None)


def _entry_point(forward: Callable, name: str) -> Callable:
    """A function that calls `forward(block, ...)`, with a code object of its own named `name`."""
    def block_entry(block, *args, **kwargs):
        return forward(block, *args, **kwargs)

    code = block_entry.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, block_entry.__globals__, name, None, block_entry.__closure__)


def _root_cause(err: BaseException) -> str:
    """The innermost exception's type and first line: Dynamo wraps backend errors in BackendCompilerFailed."""
    while (inner := getattr(err, "inner_exception", None) or err.__cause__) is not None:
        err = inner
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def wait_for_device(device_type: str) -> None:
    """CUDA runs kernels asynchronously: a timing must wait for them, or it measures only their launch."""
    if device_type == "cuda":
        torch.cuda.synchronize()


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


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """What of a call's inputs Dynamo guards on: tensor shapes, dtypes and devices, scalar values, grad mode."""
    def describe(value):
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype, value.device)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return type(value)

    return (torch.is_grad_enabled(), tuple(describe(a) for a in args),
            tuple((k, describe(v)) for k, v in kwargs.items()))


class KindEntry:
    """One block kind: its lazily compiled entry point, the path chosen for it, and its statistics."""

    def __init__(self, key: tuple, kind: BlockKind, forward: Callable, options: CompileOptions, device_type: str):
        self.key = key
        self.kind = kind
        self.options = options
        self.name = f"accel_{kind.class_name.replace('.', '_')}_{kind.signature}"
        self.compiled = torch.compile(_entry_point(forward, self.name), **compile_kwargs(options, device_type))
        self.forward = forward
        self.device_type = device_type
        self.cache_id = key_id(key)  # its name in the persistent compile cache
        self.failure: str | None = None  # set when compiling or a first compiled run failed: eager for good
        # What timing chose for callers in choose="auto" mode: None until timed, then "compiled" or "eager".
        self.auto_path: str | None = None
        self.reason = ""
        self.compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0
        self.disk_cache: Counter[str] = Counter()  # torch's on-disk cache hits and misses while compiling
        self.eager_calls: Counter[str] = Counter()
        self.recompile_reasons: list[str] = []
        self.timings: dict[str, float] = {}
        self.call_share: float | None = None  # share of a UNet call its blocks took eagerly (choose="auto")
        self.share_id = key_id(key[:4])  # the kind on this device and torch, whatever the options
        # dynamic="auto": the first input shapes compile static; once another shape is seen, inputs are marked
        # dynamic (batch, and the first input's spatial dims) so that one more compile covers every later shape.
        self.first_shapes: tuple | None = None
        self.mark_dynamic = False
        self.seen_inputs: set[tuple] = set()  # input signatures already run compiled (see _call_compiled)
        # choose="auto" (background.py): None until decided, then "queued" (captured in this call), "pending" (a
        # child compiles it), "done", "failed" (compile here), or "not needed" (the persistent cache has it).
        self.background: str | None = None
        self.background_reason = ""
        self.background_seconds: float | None = None  # the child's compile of this kind
        share = saved_share(device_type, self.share_id)
        if share is not None:
            self.note_call_share(share, measured_here=False)

    # -- background compiles (background.py) ---------------------------------------------------------------
    @property
    def waiting_for_background(self) -> bool:
        return self.background in ("queued", "pending")

    def needs_background(self) -> bool:
        """True the first time this kind must be compiled cold: never compiled here, no path chosen, and no
        artifacts of its key in the persistent cache (those load in a fraction of a compile, so they load here)."""
        if self.background is not None:
            return False
        if self.compiles or self.seen_inputs or self.auto_path is not None or self.failure:
            self.background = "not needed"
            return False
        env = COMPILE_CACHE.environment(self.device_type)
        if not env.check_usable() or env.has_artifacts(self.cache_id):
            self.background = "not needed"
            return False
        return True

    def background_done(self, seconds: float) -> None:
        self.background, self.background_seconds = "done", seconds
        self.background_reason = f"compiled in a child process in {seconds:.1f} s"

    def background_failed(self, why: str) -> None:
        self.background, self.background_reason = "failed", f"background compile failed: {why}; compiled here"
        log.warning("[Accel] %s: %s", self.kind.label, self.background_reason)

    # -- calls -----------------------------------------------------------------------------------
    def run_eager(self, block, args: tuple, kwargs: dict, reason: str):
        self.eager_calls[reason] += 1
        return self.forward(block, *args, **kwargs)

    @property
    def path(self) -> str:
        if self.failure or self.waiting_for_background:
            return "eager"
        return self.auto_path or "compiled"

    def run(self, block, make_call: Callable[[], tuple[tuple, dict]], args: tuple, kwargs: dict, choose: str):
        """Run `block` compiled when its kind runs compiled. `make_call` builds fresh (args, kwargs) for a
        compiled call; `args`/`kwargs` are the caller's own, for the eager path."""
        if self.failure or (choose == "auto" and self.auto_path == "eager"):
            return self.run_eager(block, args, kwargs, self.reason)
        frames = _dynamo_frames()
        start = time.perf_counter()
        try:
            out = self._call_compiled(block, make_call)
        except (torch.OutOfMemoryError, KeyboardInterrupt):
            raise
        except Exception as err:  # a failed compile or first run costs this kind its compiled path, not the prompt
            self._fall_back(_root_cause(err))
            return self.run_eager(block, args, kwargs, self.reason)
        new_frames = _dynamo_frames() - frames
        if new_frames:
            self._note_compile(new_frames, time.perf_counter() - start, args, kwargs)
        else:
            self.cache_hits += 1
        if choose == "auto" and self.auto_path is None:
            self._choose_path(block, make_call, args, kwargs)
        return out

    def _call_compiled(self, block, make_call: Callable[[], tuple[tuple, dict]]):
        """One compiled call. Inputs not seen before may compile, so that call runs inside the persistent cache's
        scope (torch's caches in the pack's directory, the artifacts saved); inputs already seen skip the scope's
        cost, tens of microseconds a call. Should another guard still recompile there, the graph is correct and
        merely not persisted."""
        call_args, call_kwargs = make_call()
        self._mark_shapes(call_args, call_kwargs)
        signature = input_signature(call_args, call_kwargs)
        if signature in self.seen_inputs:
            return self.compiled(block, *call_args, **call_kwargs)
        disk = disk_cache_counters()
        with COMPILE_CACHE.environment(self.device_type).compiling(self.cache_id, self.name):
            out = self.compiled(block, *call_args, **call_kwargs)
        self.disk_cache.update(disk_cache_counters() - disk)
        self.seen_inputs.add(signature)
        return out

    def _mark_shapes(self, args: tuple, kwargs: dict) -> None:
        if self.options.dynamic != "auto":
            return
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        shapes = tuple(tuple(t.shape) for t in tensors)
        if self.first_shapes is None:
            self.first_shapes = shapes
        elif shapes != self.first_shapes:
            self.mark_dynamic = True
        if self.mark_dynamic and tensors:
            from torch._dynamo import maybe_mark_dynamic  # a hint: a dim Dynamo must specialise stays static

            for tensor in tensors:
                if tensor.dim():
                    maybe_mark_dynamic(tensor, 0)
            for dim in range(2, tensors[0].dim()):
                maybe_mark_dynamic(tensors[0], dim)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _note_compile(self, frames: int, seconds: float, args: tuple, kwargs: dict) -> None:
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

    def _fall_back(self, why: str) -> None:
        self.failure = self.reason = f"compile failed: {why}"
        log.warning("[Accel] Compile Model: %s runs eagerly because compiling it failed (%s). The output is "
                    "unaffected; ACCEL_DISABLE_COMPILE=1 skips compiling altogether.", self.kind.label, why)

    def note_call_share(self, share: float, measured_here: bool = True) -> None:
        """choose="auto", before compiling: a kind too small to matter is not compiled at all. (The profile call
        that measures shares saves them for later processes: saved_shares.py.)"""
        self.call_share = share
        if share < MIN_CALL_SHARE and self.auto_path is None:
            self.auto_path = "eager"
            self.reason = (f"{100 * share:.1f}% of a UNet call when run eagerly (under {100 * MIN_CALL_SHARE:.0f}%"
                           f"{'' if measured_here else ', measured earlier'}): not worth compiling")
            log.info("[Accel] %s: not compiled, %s", self.kind.label, self.reason)

    def _choose_path(self, block, make_call, args: tuple, kwargs: dict) -> None:
        def best_of(fn) -> float:
            times = []
            for _ in range(TIMING_REPEATS):
                wait_for_device(self.device_type)
                start = time.perf_counter()
                fn()
                wait_for_device(self.device_type)
                times.append(time.perf_counter() - start)
            return min(times)

        with torch.no_grad():
            compiled_s = best_of(lambda: self._call_compiled(block, make_call))
            eager_s = best_of(lambda: self.forward(block, *args, **kwargs))
        self.timings = {"compiled_s": compiled_s, "eager_s": eager_s}
        self.auto_path = "compiled" if compiled_s < eager_s * FASTER_MARGIN else "eager"
        self.reason = f"compiled {compiled_s * 1e3:.2f} ms vs eager {eager_s * 1e3:.2f} ms per call"
        log.info("[Accel] %s: keeping the %s path (%s)", self.kind.label, self.path, self.reason)

    def stats(self) -> dict[str, Any]:
        return {
            "kind": self.kind.label, "entry": self.name, "path": self.path, "timed": self.auto_path is not None,
            "reason": self.reason,
            "compiles": self.compiles, "recompiles": max(0, self.compiles - 1) if self.compiles else 0,
            "recompile_reasons": list(self.recompile_reasons), "compile_seconds": round(self.compile_seconds, 3),
            "cache_hits": self.cache_hits, "disk_cache": dict(self.disk_cache),
            "eager_calls": dict(self.eager_calls), "timings": self.timings,
            "call_share": round(self.call_share, 4) if self.call_share is not None else None,
            "background": {"state": self.background, "reason": self.background_reason,
                           "seconds": self.background_seconds},
        }


class GraphRegistry:
    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[tuple, KindEntry] = {}
        self._models: dict[str, set[tuple]] = {}
        self._step_checks: list = []  # choose="auto": each model's whole-call check (step_check.StepCheck)

    def entry(self, kind: BlockKind, forward: Callable, options: CompileOptions, device: torch.device) -> KindEntry:
        key = (kind.class_name, kind.signature, device_signature(device), torch.__version__,
               options.cache_key(device.type))
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                found = self._entries[key] = KindEntry(key, kind, forward, options, device.type)
            return found

    def forget_shapes(self) -> None:
        """Back to "no shape seen yet" for every kind, as in a fresh process (used by precompile only)."""
        with self._lock:
            for entry in self._entries.values():
                entry.first_shapes, entry.mark_dynamic = None, False
                entry.seen_inputs.clear()

    def note_model(self, model_label: str, keys: set[tuple]) -> None:
        with self._lock:
            self._models.setdefault(model_label, set()).update(keys)

    def note_step_check(self, check) -> None:
        with self._lock:
            self._step_checks.append(check)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            entries = list(self._entries.values())
            models = {label: sorted(self._entries[k].name for k in keys) for label, keys in self._models.items()}
            step_checks = {check.model_label: check.stats() for check in self._step_checks}
        kinds = [e.stats() for e in entries]
        return {
            "kinds": kinds,
            "models": models,
            "whole_call_checks": step_checks,
            "totals": {
                "kinds": len(kinds),
                "compiles": sum(k["compiles"] for k in kinds),
                "recompiles": sum(k["recompiles"] for k in kinds),
                "cache_hits": sum(k["cache_hits"] for k in kinds),
                "compile_seconds": round(sum(k["compile_seconds"] for k in kinds), 3),
                "disk_cache": dict(sum((Counter(k["disk_cache"]) for k in kinds), Counter())),
            },
            "compile_cache": COMPILE_CACHE.stats(),
            "background": BACKGROUND.stats(),
        }


REGISTRY = GraphRegistry()
