"""The background child's lifetime, for the jobs' side (parent.py): which child a job is sent to (the waiting one,
or a new one for another environment or set-up), and when the waiting one goes (after the idle time that follows
a job, at once, or before the compile cache is cleared). Only this process decides that (it closes the child's
stdin), under the `BackgroundCompiler`'s lock, so a job is never sent to a child that is leaving."""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

from .worker import Worker, child_setup, idle_seconds, start_worker


class WorkerKeeper:
    """The child waiting for jobs, if any, and the timer that retires it once it has been idle a while. Guarded by
    the lock it is given (the `BackgroundCompiler`'s): its methods are called with it held, but for the timer's and
    `forget_ended`, which take it."""

    def __init__(self, lock: threading.Lock, still_idle: Callable[[], bool]):
        self._lock = lock
        self._still_idle = still_idle  # no job runs or waits (the lock held): the timer may retire the child
        self._worker: Worker | None = None
        self._idle_timer: threading.Timer | None = None

    def worker_for(self, env_dir: Path) -> Worker:
        """The waiting child if it was started for this environment and set-up, else a new one."""
        setup = child_setup(env_dir)
        key = json.dumps(setup, sort_keys=True)
        if self._worker is not None and self._worker.key == key and self._worker.alive():
            return self._worker
        if self._worker is not None:
            self._worker.retire()
        self._worker = start_worker(env_dir, setup, key)
        return self._worker

    def retire_when_idle(self, device_type: str) -> None:
        """After a job on `device_type`, with none queued: the child goes after the idle time, or now."""
        if self._worker is None:
            return
        idle = idle_seconds(device_type)
        if idle <= 0:
            self.retire()
            return
        self._idle_timer = threading.Timer(idle, self._retire_if_still_idle)
        self._idle_timer.daemon = True
        self._idle_timer.start()

    def _retire_if_still_idle(self) -> None:
        with self._lock:
            if self._still_idle():
                self.retire()

    def retire(self) -> None:
        """The waiting child, if any, gets no more jobs (worker.py: it ends after the one it has)."""
        self.cancel_idle_timer()
        if self._worker is not None:
            self._worker.retire()
            self._worker = None

    def forget_ended(self, worker: Worker) -> None:
        """`worker` ended in its job (it crashed, or was killed): the next job gets a new child. Takes the lock
        (called on the loader thread, while a job's results are read)."""
        with self._lock:
            if self._worker is worker:
                self._worker = None

    def cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
