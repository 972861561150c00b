"""When held background work may start on a CPU machine with few cores: at the first idle moment of this process
after the sampling run, not as soon as the sampler returns.

A background child's start (imports, torch's CPU checks: new Python processes) and inductor's CPU-checks thread
take the CPU's cores. Started when the sampler returned, they ran beside the rest of the prompt, whose VAE decode
then took 0.47 s against eager's 0.11 s (the small SD1.5 UNet's first prompt, 1.25x eager's in all: bench/report.py
quick run, 2026-11-23). Held until the process goes idle (the prompt done, ComfyUI waiting for the next), they
cost the prompt nothing.

"Idle" is this process's own CPU time (every thread, `time.process_time`) growing by less than a quarter of a core
over a short window while no sampling run is in progress. What waits is released at that moment, or when
`BackgroundCompiler.wait` asks for it, or at the latest once it has waited `ACCEL_BACKGROUND_IDLE_WAIT` seconds
(default 20) outside sampling runs, added up over the runs: prompts that follow one another with no pause then get
their compiled blocks (the work starts between two of them, once their decodes and the rest have added up to the
wait), instead of never (the wait was counted from the last run's end, so a queue of prompts held it to its end).
Work never starts inside a sampling run here; the sampler's OUTER_SAMPLE wrapper marks each run (patcher.py).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from ...env_settings import env_float, env_switch
from ...thread_names import start_thread

log = logging.getLogger("comfyui_accel")

AT_ONCE_ENV = "ACCEL_BACKGROUND_AT_ONCE"  # 1: never hold a job for an idle moment
FEW_CORES = 4  # CPU machines with at most this many cores hold jobs for an idle moment
MAX_WAIT_ENV = "ACCEL_BACKGROUND_IDLE_WAIT"
DEFAULT_MAX_WAIT = 20.0
WINDOW_SECONDS = 0.3
IDLE_SHARE = 0.25  # of one core: ComfyUI waiting for a prompt uses next to nothing


class IdleGate:
    """Callbacks waiting for this process to be idle outside a sampling run; one watcher thread while any wait."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting: list[Callable[[], None]] = []
        self._sampling = 0  # sampling runs in progress (nested samplers count each)
        self._outside_since: float | None = None  # when the wait outside a sampling run began
        self._outside_before = 0.0  # seconds waited outside earlier sampling runs' gaps, since the work began to wait
        self._watcher: threading.Thread | None = None
        self.released: list[str] = []  # why each release happened, for stats and tests
        self.runs = 0  # sampling runs started in this process (auto mode re-checks a close call a few runs later)

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the watcher thread) at the next idle moment outside a sampling run."""
        with self._lock:
            if callback not in self._waiting:
                self._waiting.append(callback)
            if self._outside_since is None and not self._sampling:
                self._outside_since = time.monotonic()
            if self._watcher is None:
                self._watcher = start_thread("accel-idle-gate", self._watch)

    def sampling_started(self) -> None:
        with self._lock:
            self._sampling += 1
            self.runs += 1
            if self._outside_since is not None:
                self._outside_before += time.monotonic() - self._outside_since
            self._outside_since = None

    def sampling_ended(self) -> None:
        with self._lock:
            self._sampling = max(0, self._sampling - 1)
            if not self._sampling and self._waiting:
                self._outside_since = time.monotonic()

    def release_now(self, why: str = "asked for") -> None:
        """Run what waits now, in the caller's thread (someone waits for the background work)."""
        self._release(why)

    @property
    def sampling(self) -> bool:
        return bool(self._sampling)

    @property
    def holding(self) -> bool:
        return bool(self._waiting)

    def stats(self) -> dict:
        return {"waiting": len(self._waiting), "sampling": bool(self._sampling), "released": self.released[-5:]}

    def _watch(self) -> None:
        last_cpu, last_time = time.process_time(), time.monotonic()
        while True:
            time.sleep(WINDOW_SECONDS)
            cpu, now = time.process_time(), time.monotonic()
            share = (cpu - last_cpu) / max(now - last_time, 1e-3)
            last_cpu, last_time = cpu, now
            with self._lock:
                if not self._waiting:
                    self._watcher = None
                    return
                if self._sampling:
                    continue
                waited = self._outside_before + now - (self._outside_since or now)
                why = ("idle" if share < IDLE_SHARE
                       else "waited long enough" if waited >= _max_wait() else None)
            if why:
                self._release(why)

    def _release(self, why: str) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
            self._outside_since, self._outside_before = None, 0.0
        if not waiting:
            return
        self.released.append(why)
        for callback in waiting:
            try:
                callback()
            except Exception:  # noqa: BLE001  (one failed start must not keep the others waiting)
                log.exception("[Accel] background work held for an idle moment failed to start")


def _max_wait() -> float:
    return env_float(MAX_WAIT_ENV, DEFAULT_MAX_WAIT)


def hold_until_idle(device_type: str) -> bool:
    """Whether background work waits for an idle moment of this process (idle_gate.py): on a CPU machine with
    few cores."""
    if env_switch(AT_ONCE_ENV) is not None:
        return False
    return device_type == "cpu" and (os.cpu_count() or 1) <= FEW_CORES

IDLE_GATE = IdleGate()
