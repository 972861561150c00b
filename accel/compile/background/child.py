"""The child's side of the background compiler: `python -m accel compile-worker DIR`.

It runs with the parent's ComfyUI flags, torch thread count (inductor's CPU kernels are built for it) and grad
mode, and takes jobs one at a time: a job directory per line on its stdin, until the end of its stdin (the parent
decides when it goes). For each job it rebuilds each captured block from its skeleton and compiles it for each
captured input layout, through a registry entry made the way a compiled call in ComfyUI's process makes it, so
the graphs land in the persistent cache under the keys the parent asks for. Every job starts from the state a
new process would have (a registry of its own, Dynamo's caches reset): only the imports and torch's per-process
checks carry over, which is what staying is for.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import pickle
import sys
import time
import traceback
from pathlib import Path

import torch
import torch._dynamo

from ...thread_names import start_thread
from .batch_twin import batch_of, batch_twin
from .skeleton import load_skeleton

log = logging.getLogger("comfyui_accel")
NICE_ENV = "ACCEL_BACKGROUND_NICE"  # set: the child runs at this niceness instead of the idle scheduling class
FALLBACK_NICE = 19  # where the idle class is not available
PARENT_GONE = 3  # the exit code when ComfyUI's process ended first: nobody will use what this compiles


def serve(worker_dir: Path) -> int:
    """Compile the jobs named on stdin, one at a time; each job's done.json says how it ended."""
    _lower_priority()
    setup = json.loads((worker_dir / "setup.json").read_text())
    _exit_with(setup["parent"])
    from ...comfy_import import import_comfyui_core

    flags = {k: v for k, v in setup["flags"].items() if k != "cpu"}
    import_comfyui_core(Path(setup["comfyui"]), setup["flags"].get("cpu", False), **flags)
    torch.set_num_threads(setup["threads"])
    from ...cache.store import write_atomic
    from .worker import DONE_FILE

    failures = 0
    for line in sys.stdin:
        directory = Path(line.strip())
        log.info("[Accel] background compile: job %s", directory.name)
        try:
            returncode, error = run_job(directory, setup["parent"]), None
        except Exception as err:  # noqa: BLE001  (the job fails, and says why; the next one may not)
            traceback.print_exc()
            returncode, error = 1, f"{type(err).__name__}: {err}"[:500]
        failures += returncode != 0
        write_atomic(directory / DONE_FILE, json.dumps({"returncode": returncode, "error": error}).encode())
        if returncode == PARENT_GONE:
            return PARENT_GONE
        _forget_jobs_state()
    if not failures:  # its log is quoted when a job fails; kept then
        import shutil

        shutil.rmtree(worker_dir, ignore_errors=True)
    return 0


def run_job(directory: Path, parent: int) -> int:
    """Compile every captured kind of a job into the persistent cache; results.json says what happened."""
    with open(directory / "job.pkl", "rb") as handle:
        job = pickle.load(handle)
    from ...cache.store import write_atomic
    from ..registry import GraphRegistry

    registry = GraphRegistry()  # the job's own: kinds start with no shapes seen, as in a new process
    results = []
    for item in job["items"]:
        if os.getppid() != parent:
            return PARENT_GONE
        results.append(compile_item(item, registry))
        write_atomic(directory / "results.json",
                     json.dumps({"kinds": results, "peak_rss_mib": _peak_rss_mib()}, indent=1).encode())
    return 0


def compile_item(item: dict, registry) -> dict:
    """Compile one captured kind (a job item, capture.Capture.job_item) for each of its calls' layouts, in their
    order, through an entry of `registry`, then save its graphs whole; what happened, as results.json lists it.
    Also `python -m accel precompile`'s last step, in its own process (accel/precompile.py)."""
    from ..blocks import BlockKind
    from ..options import CompileOptions

    block = load_skeleton(item["block"])
    entry = registry.entry(BlockKind(*item["kind"]), getattr(type(block), item["attribute"]),
                           CompileOptions(**item["options"]), torch.device(item["device"]))
    # a new shape of a kind the parent runs: the dimensions it already made dynamic stay so here
    entry.shapes.dynamic_dims.update(tuple(d) for d in item.get("dynamic_dims", ()))
    start = time.perf_counter()
    marks = []  # per call, the dimensions its compiled call marked dynamic
    batches = set()  # the calls' batches (batch_twin.batch_of)
    # A graph break raises at once (Dynamo's error_on_graph_break) instead of compiling the kind as several graphs:
    # those could not be saved whole, and the parent runs such a kind eagerly (kind_choice.compiles_only_in_pieces),
    # so compiling them was wasted (Wan's VAE encode: 29 graphs, 105 s of a child here, 2026-11-27).
    with torch.inference_mode(item["inference"]), torch.set_grad_enabled(item["grad"]), \
            torch._dynamo.error_on_graph_break(True):
        for call in item["calls"]:
            args, kwargs = load_skeleton(call)
            batches.add(batch_of(args, kwargs))
            entry.run_compiled(block, lambda: (args, kwargs), args, kwargs)  # noqa: B023
            marks.append(set(entry.shapes.dynamic_dims))
            if entry.failure:
                break
    # a graph break, not a failure
    in_pieces = entry.failed_with is not None and issubclass(entry.failed_with, torch._dynamo.exc.Unsupported)
    failure = None if in_pieces else entry.failure
    with torch.inference_mode(item["inference"]), torch.set_grad_enabled(item["grad"]):
        compiled_seconds = time.perf_counter() - start
        precompiled, torch_refused = (None, False) if entry.failure else save_precompiled(
            entry, block, item["calls"], marks, batches, {"grad": item["grad"], "inference": item["inference"]})
    if in_pieces:
        precompiled = entry.failure.removeprefix("compile failed: ")  # why: what Dynamo could not trace whole
    result = {"cache_id": entry.cache_id, "kind": entry.kind.label, "failure": failure,
              "seconds": round(time.perf_counter() - start, 2), "compiles": entry.compiles,
              "fx_graph_misses": entry.disk_cache.get("fx_graph_misses", 0), "precompiled": precompiled,
              "precompile_refused": torch_refused, "graph_breaks": entry.graph_breaks or in_pieces}
    log.info("[Accel] compiled %s in %.1f s (precompiled: %s in %.1f s)%s", entry.kind.label,
             compiled_seconds, precompiled, result["seconds"] - compiled_seconds,
             f" (failed: {entry.failure})" if entry.failure else "")
    return result


def save_precompiled(entry, block, calls: list[bytes], marks: list[set], batches: set,
                     modes: dict) -> tuple[int | str, bool]:
    """Save the kind's graph for each call's layouts as a precompiled function (compile/precompiled.py), after the
    compiled calls above (its graphs then come from torch's caches they filled), under the grad and inference modes
    of the captured call (`modes`, kept in each file: its guards are rebuilt under them when loaded); beside a
    dynamic graph made at a batch of 1, its twin for larger batches (batch_twin.py, given the calls' `batches`),
    compiled here. Returns the number saved, or why none, and whether torch refused a graph (it raised while
    saving or loading one back: a block that does not compile whole, or what ComfyUI 0.33's dtype records did
    before precompiled.LOAD_RECORD_SUFFIX); then the kind loads the old way in ComfyUI's process, which the parent
    warns of (state.py). Precompiling switched off or missing from torch is no refusal."""
    from ...cache import COMPILE_CACHE
    from .. import precompiled
    from ..kinds import _entry_point, compile_kwargs
    from ..shapes import input_signature

    why = precompiled.unavailable()
    if why:
        return why, False
    env = COMPILE_CACHE.environment(entry.device_type)
    if not env.check_usable():
        return f"no usable compile cache ({env.problem})", False
    entry_point = _entry_point(entry.forward, entry.name)
    kwargs_for_compile = compile_kwargs(entry.options, entry.device_type)
    saved, done = 0, set()

    def save(args: tuple, kwargs: dict, dims: set) -> None:
        """One precompiled function for these inputs, unless saved already; raises what torch raises."""
        nonlocal saved
        key = (input_signature(args, kwargs), tuple(sorted(dims)))
        if key in done:
            return
        done.add(key)
        context = precompiled.context_of(block, entry.forward, args, kwargs)
        name = precompiled.file_name(context, key)
        with env.compiling(entry.cache_id, entry.name):  # torch's caches: the graphs compiled above (not a twin's)
            function = precompiled.precompile(entry_point, kwargs_for_compile, block, args, kwargs, dims)
        with env.loading():
            payload, layout = precompiled.pack(function, precompiled.kernels_of(function, env.inductor_dir))
        env.save_precompiled(entry.cache_id, name, payload, entry.kind.label,
                             {"name": name, "format": precompiled.FORMAT, "context": context, **modes, **layout})
        saved += 1

    for call, dims in zip(calls, marks):
        try:
            save(*load_skeleton(call), dims)  # fresh tensors: the calls above may have changed theirs in place
        except Exception as err:  # noqa: BLE001  (the kind still has its graphs in torch's caches)
            why = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
            log.info("[Accel] background compile: %s cannot be precompiled (%s)", entry.kind.label, why)
            return why, True
        twin = batch_twin(block, *load_skeleton(call), dims, batches)
        if twin is not None:
            try:
                save(*twin, dims)
            except Exception as err:  # noqa: BLE001  (a batch change then needs a job, as without the twin)
                log.info("[Accel] background compile: %s has no graph for larger batches (%s: %s)",
                         entry.kind.label, type(err).__name__, str(err).strip()[:200])
    return saved, False


def _forget_jobs_state() -> None:
    """Between jobs: Dynamo's compiled code and guards go (the next job's kinds compile, from the cache where it
    can, as a new process's would, and never meet the recompile limit of an earlier job's entries)."""
    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_initialized():  # the skeletons' device memory goes back to the GPU while this waits
        torch.cuda.empty_cache()


def _exit_with(parent: int) -> None:
    """A compile nobody will load is wasted CPU: this process ends within a second of ComfyUI's. (Not the kernel's
    parent-death signal: it fires when the *thread* that started this process ends, and the idle gate's thread,
    which starts held jobs, ends whenever nothing waits.)"""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(PARENT_GONE)

    if os.getppid() != parent:
        sys.exit(PARENT_GONE)  # ComfyUI ended before this process could watch it
    start_thread("accel-watch", watch)


def _lower_priority() -> None:
    """The sampler keeps the CPU: on Linux the child (and the C++ compilers it starts, which inherit it) runs in
    the idle scheduling class, only on CPU time nothing else wants. A mere niceness still takes a share of a
    busy core, and torch's CPU threads wait for each other, so a share taken from one slows them all. NICE_ENV
    set to a whole number runs it at that niceness instead; a value that is not one is said, and ignored. Windows
    has neither: the child runs at its normal priority there."""
    raw, nice = os.environ.get(NICE_ENV, "").strip(), None
    if raw:
        try:
            nice = int(raw)
        except ValueError:
            log.warning("[Accel] %s=%r is not a whole number; the background compile runs in the idle scheduling "
                        "class", NICE_ENV, raw)
    if nice is None and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
    if hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(FALLBACK_NICE if nice is None else nice)


def _peak_rss_mib() -> int | None:
    """This process's own peak so far (VmHWM): getrusage's ru_maxrss would carry over the parent's peak across
    exec."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024)
    return None
