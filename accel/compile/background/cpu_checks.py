"""Inductor's per-process CPU checks, run in a thread of their own while the process is idle, so that loading
compiled graphs never waits for them in a prompt.

Before its first C++ kernel in a process, compiled or loaded from the cache, inductor checks which vector
instruction sets the C++ compiler builds for, each by loading a test library in a new Python process
(torch/_inductor/cpu_vec_isa.py). On CPUs that list AVX-512 VNNI and AMX these checks run even with the pack's
`cpp.vec_isa_ok` (cpu_isa.py): about 11 s on the 2-core test CPU, in every process (docs/benchmarks/cold_start.md).
A restarted ComfyUI whose block kinds were all in the persistent cache loaded them at its first sampling, so its
first prompt took 19.5 s where eager took 1.5 s (bench/report.py, 2026-11-23).

So on the CPU, with choose=auto and a background compile:
- a kind found precompiled in the persistent cache waits for the checks (its blocks run eagerly, like a kind a
  child compiles), then loads at the next idle moment (loader.py), in about 0.1 s;
- the checks start in a daemon thread at this process's next idle moment on a CPU with at most 4 cores (the
  sampler and the VAE decode need them; as held background jobs, idle_gate.py), at once elsewhere; also when
  kinds go to a child, so the process has them done when the child's graphs come back.
torch keeps each check's answer for the process (functools caches), so the compile that follows reuses them;
the thread only calls torch's own check. The checks are mostly waiting for those new processes, so the thread
holds Python's lock little. On a GPU nothing waits (its kernels are not C++).
"""
from __future__ import annotations

import logging
import threading
import time

from ... import telemetry
from ...thread_names import start_thread
from .activity import ACTIVITY
from ..precompiled import warm_loader
from .idle_gate import IDLE_GATE
from .loader import LOADER
from .state import KindBackground

log = logging.getLogger("comfyui_accel")


class CpuChecks:
    """Runs inductor's CPU checks once per process, in a thread, and hands the kinds waiting for them back."""

    def __init__(self):
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._wanted = False  # something in this process will load or compile C++ kernels
        self._waiting: list[KindBackground] = []
        self.seconds: float | None = None
        self.error: str | None = None

    def want(self, hold: bool) -> None:
        """This process will need the checks: run them now, or (`hold`) at its next idle moment."""
        with self._lock:
            if self._done.is_set() or self._thread is not None:
                return
            self._wanted = True
            if not hold:
                self._start()
                return
        IDLE_GATE.when_idle(self.release)

    def wait_for_them(self, background: KindBackground, hold: bool) -> bool:
        """`background`'s kind waits for the checks; False when they are done already (it loads now)."""
        with self._lock:
            if self._done.is_set():
                return False
            background.await_cpu_checks()
            self._waiting.append(background)
        self.want(hold)
        return True

    def release(self) -> None:
        """Start the checks if they were held for an idle moment (or someone waits for them)."""
        with self._lock:
            if self._wanted and self._thread is None and not self._done.is_set():
                self._start()

    def wait(self, timeout: float | None = None) -> bool:
        """Start the checks if wanted and wait for them; False on timeout."""
        self.release()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def busy(self) -> bool:
        """Kinds wait for the checks, or the checks run."""
        return bool(self._waiting) or (self._thread is not None and not self._done.is_set())

    def stats(self) -> dict:
        state = ("done" if self._done.is_set() else "running" if self._thread is not None
                 else "held until the process is idle" if self._wanted else "not needed yet")
        return {"state": state, "seconds": self.seconds, "error": self.error,
                "kinds_waiting": [b.label for b in self._waiting]}

    def _start(self) -> None:  # with the lock held
        self._thread = start_thread("accel-cpu-check", self._run)

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            from torch._inductor import cpu_vec_isa

            with ACTIVITY.running("inductor's CPU checks"):  # new processes: no timing is taken beside them
                cpu_vec_isa.valid_vec_isa_list()  # torch's own checks; it caches the answer for the process
                warm_loader()  # and what loading a first precompiled function imports
        except Exception as err:  # noqa: BLE001  (the compile that follows checks again, as without this)
            self.error = f"{type(err).__name__}: {err}"[:300]
            log.warning("[Accel] inductor's CPU checks failed in their thread (%s); the next compile runs them",
                        self.error)
        self.seconds = round(time.perf_counter() - start, 2)
        with self._lock:
            self._done.set()
            waiting, self._waiting = self._waiting, []
        for background in waiting:
            background.cpu_checks_done()
        LOADER.load_when_idle([])  # kinds found precompiled, waiting for these checks to load
        log.info("[Accel] inductor's CPU checks done in %.1f s off the prompt's path", self.seconds)
        telemetry.record("compile_model", "cpu_checks_done", seconds=self.seconds)  # kinds found in the cache move


CPU_CHECKS = CpuChecks()
