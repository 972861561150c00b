"""Loading kinds' precompiled functions at an idle moment, not in the prompt that first needs them.

Loading a kind's precompiled functions (precompiled.py) takes about 0.1 s on the 2-core test CPU: nothing in a
prompt of seconds, but 3.5x a 50 ms prompt of the generated SD3 transformer (bench/soak.py, 2026-11-25). So the
kinds a child just compiled, and those a restarted process found precompiled, are loaded here at this process's
next idle moment (idle_gate.py), outside any sampling run; a kind whose call comes first loads in that call, as
before. Loading runs no kernel (deserialising the function, importing its wrapper code, opening its kernel
libraries), so this thread opens no OpenMP pool beside the sampler's.

One thread for the life of the process, as ComfyUI's prompt thread: with torch 2.11 on a machine without CUDA, a
thread that had run torch's compile machinery and then ended made a later compile in another thread crash
(FakeTensorMode's `_ensureCUDADeviceGuardSet`, seen with the preload this replaced).

The same thread does the pack's other allocation work that need not run where it is asked for: a load someone
waits for (`load_all_now`), reading a finished child's results (`run_here`), and watching a running job until it
ends (`watch`, which replaced a new thread per job). glibc gives each thread an arena of its own; what the pack
allocates in ComfyUI's prompt thread, long-lived or freed, lands in the arena the sampler's CPU tensors come from,
and a thread's heap filled near its end sends each large allocation through a new heap and back to the main
arena, several system calls a step (docs/process_tax.md, "the band"). One long-lived thread keeps all of it in
one arena of its own; a new thread per job would reuse a freed arena glibc hands the next thread.
"""
from __future__ import annotations

import logging
import threading

from ...malloc.tune import TUNE
from ...thread_names import start_thread
from .activity import ACTIVITY
from .idle_gate import IDLE_GATE

log = logging.getLogger("comfyui_accel")
WATCH_SECONDS = 0.25  # how often a watched job is looked at (the job-wait thread's old period)


class Loader:
    """Kinds whose precompiled functions are due (KindEntry.precompiled.due), loaded at idle moments."""

    def __init__(self):
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._settled = threading.Condition(self._lock)  # a load under way ended (`_loading` emptied)
        self._due: list = []  # KindEntry, in the order they came
        self._loading: list = []  # taken from _due by a load under way: still to come for `pending`
        self._asked = False  # a wake the thread has not acted on yet (never lost: it may come before its wait)
        self._thread: threading.Thread | None = None
        self._tasks: list = []  # (function, box) run_here hands to the thread, in order
        self._watched: list = []  # functions called every WATCH_SECONDS until one returns True

    def load_when_idle(self, entries: list) -> None:
        """Load `entries`' due functions at the next idle moment (those still due then)."""
        with self._lock:
            self._due += [e for e in entries if e not in self._due]
            if not self._due:
                return
        IDLE_GATE.when_idle(self.wake)

    def wake(self) -> None:
        """Try now (an idle moment came, or inductor's CPU checks are done): what cannot load yet stays."""
        with self._wake:
            self._asked = True
            self._start_thread()
            self._wake.notify()

    def _start_thread(self) -> None:
        """(the lock held)"""
        if self._thread is None:
            self._thread = start_thread("accel-loader", self._serve)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def run_here(self, function, *args):
        """`function(*args)` on the loader thread, waited for (its result returned, its exception raised); at
        once when called from that thread."""
        if threading.current_thread() is self._thread:
            return function(*args)
        box = {"done": threading.Event()}
        with self._wake:
            self._tasks.append((lambda: function(*args), box))
            self._start_thread()
            self._wake.notify()
        box["done"].wait()
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def watch(self, check) -> None:
        """Call `check()` on the loader thread every WATCH_SECONDS until it returns True (or raises: logged)."""
        with self._wake:
            self._watched.append(check)
            self._start_thread()
            self._wake.notify()

    @property
    def pending(self) -> list[str]:
        """Kinds still to load, those loading now included (BACKGROUND.busy: what the demo and tests wait on)."""
        with self._lock:
            loading, due = list(self._loading), list(self._due)
        return [e.kind.label for e in loading] + [e.kind.label for e in due if e.precompiled.due]

    def load_all_now(self) -> None:
        """Load every due kind that can load, on the loader thread, while the caller waits (someone waits for the
        background work). A load the thread has under way ends first: it may hand its kinds back for a later
        idle moment (a sampling began), and a caller that returned meanwhile would find them not loaded (seen:
        the waits of tests/vae_background_probe.py, whose decodes then ran eagerly)."""
        self.run_here(self._load_all_now_here)

    def _load_all_now_here(self) -> None:
        with self._settled:
            self._settled.wait_for(lambda: not self._loading)
        self._load_what_can(stop_for_sampling=False)

    def _serve(self) -> None:
        while True:
            with self._wake:
                if self._watched:  # a look at them every WATCH_SECONDS, sooner for a wake or a task
                    self._wake.wait_for(lambda: self._asked or self._tasks, timeout=WATCH_SECONDS)
                else:  # a check watched from now on is looked at once at once
                    self._wake.wait_for(lambda: self._asked or self._tasks or self._watched)
                asked, self._asked = self._asked, False
                tasks, self._tasks = self._tasks, []
                watched = list(self._watched)
            for task, box in tasks:
                try:
                    box["result"] = task()
                except BaseException as err:  # noqa: BLE001  (raised in the caller's thread)
                    box["error"] = err
                finally:
                    box["done"].set()
            self._check(watched)
            if asked:
                self._load_what_can(stop_for_sampling=True)

    def _check(self, watched: list) -> None:
        finished = []
        for check in watched:
            try:
                if check():
                    finished.append(check)
            except Exception as err:  # noqa: BLE001  (a job's hand-back goes on at its next call's poll)
                log.warning("[Accel] Compile Model: watching a background job failed (%s); its next call hands it "
                            "back", err)
                finished.append(check)
        if finished:
            with self._lock:
                self._watched = [c for c in self._watched if c not in finished]

    def _load_what_can(self, stop_for_sampling: bool) -> None:
        with self._lock:
            due, self._due = self._due, []
            self._loading += due
        waiting = []
        try:
            for index, entry in enumerate(due):
                if stop_for_sampling and IDLE_GATE.sampling:  # the rest at the next idle moment
                    waiting += due[index:]
                    break
                try:
                    with ACTIVITY.running("a load of precompiled graphs"):  # no timing is taken beside it
                        loaded = entry.load_precompiled()
                except Exception as err:  # noqa: BLE001  (the kind loads at its next call instead)
                    log.info("[Accel] Compile Model: loading %s's precompiled graphs failed here (%s); they load at "
                             "its next call", entry.kind.label, err)
                    continue
                if not loaded and entry.precompiled.due:  # not yet (inductor's CPU checks): kept for later
                    waiting.append(entry)
        finally:
            with self._lock:
                self._loading = [e for e in self._loading if e not in due]
                self._due = waiting + [e for e in self._due if e not in waiting]
                self._settled.notify_all()
        if due:
            TUNE.recheck()  # a library a load mapped may have lowered the malloc tune: raised again, logged
        with self._lock:
            retry = bool(self._due) and stop_for_sampling and IDLE_GATE.sampling
        if retry:
            IDLE_GATE.when_idle(self.wake)


LOADER = Loader()
