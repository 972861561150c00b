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
"""
from __future__ import annotations

import logging
import threading

from ...thread_names import start_thread
from .activity import ACTIVITY
from .idle_gate import IDLE_GATE

log = logging.getLogger("comfyui_accel")


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
            if self._thread is None:
                self._thread = start_thread("accel-loader", self._serve)
            self._wake.notify()

    @property
    def pending(self) -> list[str]:
        """Kinds still to load, those loading now included (BACKGROUND.busy: what the demo and tests wait on)."""
        with self._lock:
            loading, due = list(self._loading), list(self._due)
        return [e.kind.label for e in loading] + [e.kind.label for e in due if e.precompiled.due]

    def load_all_now(self) -> None:
        """Load every due kind that can load, in the caller's thread (someone waits for the background work).
        A load the thread has under way is waited for first: it may hand its kinds back for a later idle moment
        (a sampling began), and a caller that returned meanwhile would find them not loaded (seen: the waits of
        tests/vae_background_probe.py, whose decodes then ran eagerly)."""
        with self._settled:
            self._settled.wait_for(lambda: not self._loading)
        self._load_what_can(stop_for_sampling=False)

    def _serve(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._asked)
                self._asked = False
            self._load_what_can(stop_for_sampling=True)

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
        with self._lock:
            retry = bool(self._due) and stop_for_sampling and IDLE_GATE.sampling
        if retry:
            IDLE_GATE.when_idle(self.wake)


LOADER = Loader()
