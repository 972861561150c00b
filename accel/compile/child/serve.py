"""The child process's main loop: `python -m accel compile-worker DIR` (accel/__main__.py).

It runs with the parent's ComfyUI flags, torch thread count (inductor's CPU kernels are built for it) and grad
mode, and takes jobs one at a time: a job directory per line on its stdin, until the end of its stdin (the parent
decides when it goes). For each job it rebuilds each captured block from its skeleton and compiles it for each
captured input layout, through a registry entry made the way a compiled call in ComfyUI's process makes it, so
the graphs land in the persistent cache under the keys the parent asks for. Every job starts from the state a
new process would have (a registry of its own, Dynamo's caches reset): only the imports and torch's per-process
checks carry over, which is what staying is for. Each kind of a job is compiled and saved by compile_kind.py.
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

from ...thread_names import start_thread
from .compile_kind import compile_item

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
    from ..background.worker import DONE_FILE

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
