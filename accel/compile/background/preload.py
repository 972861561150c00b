"""Loading compiled graphs between prompts instead of in the next prompt, on the CPU.

When a child has compiled a kind, this process still has to load its graphs: Dynamo traces the block again and
torch's on-disk caches give the compiled code. Done at the kind's next call, that is in the next prompt: on the
small SD1.5 UNet the prompt after the background compile took 6.9 s against eager's 1.2 s (bench/report.py quick
run, 2026-11-23), most of it Dynamo tracing 5 graphs. So once the child is done, the kinds it compiled are
loaded at this process's next idle moment (idle_gate.py), outside any sampling run, by replaying the input
layouts the child compiled from on one real block of each kind (KindEntry.preload): the same graphs, from the
same cache, with new tensors, never the model's inputs. Kinds a restarted process found in the cache, which run
eagerly until inductor's CPU checks ran (cpu_checks.py), load the same way once the checks are done, from the
input layouts of their calls while they waited (`note_call`).

A sampling run that starts meanwhile stops the preload after the kind it is loading (the rest load at their next
call, or at the next idle moment); a kind being loaded makes its blocks' compiled calls wait for it (the entry's
lock), never compile it twice. Someone waiting for the background work (BackgroundCompiler.wait) loads what is
left at once.

Every preload compiles on one thread of its own that lives as long as the process: with torch 2.11 on a machine
without CUDA, a thread that compiled and then ended made the next compile in another thread crash the process
(a segmentation fault in FakeTensorMode's `_ensureCUDADeviceGuardSet`, reproduced with two plain torch.compile
calls); ComfyUI's own prompt thread lives as long, and the idle gate's thread ends when nothing waits.

CPU kinds only: on a GPU, tracing beside a sampler would take the Python thread that launches its kernels, and
none of this is verified there; GPU kinds load at their next call as before. `ACCEL_PRELOAD=0` turns it off.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from ... import telemetry
from .activity import ACTIVITY
from .idle_gate import IDLE_GATE
from .openmp import release_this_threads_pool
from .state import BackgroundState

log = logging.getLogger("comfyui_accel")

ENV = "ACCEL_PRELOAD"
MAX_NOTED_CALLS = 4  # input signatures noted per kind found in the cache (a UNet kind meets 2 or 3 sizes)
LOADABLE = (BackgroundState.DONE, BackgroundState.NOT_NEEDED)  # a child's graphs, or found in the cache


def enabled(device_type: str) -> bool:
    return device_type == "cpu" and os.environ.get(ENV, "1") not in ("0", "")


@dataclass
class Replay:
    """What to replay for one kind: the capture of its calls' input layouts (parent.Capture), and one real block
    of the kind, held weakly (a model deleted meanwhile is not kept alive for this)."""
    capture: Any
    block: weakref.ref


class Preloader:
    """Kinds to load at the next idle moment (or when someone waits for them), and what each replays."""

    def __init__(self):
        self._lock = threading.Lock()  # the state below
        self._changed = threading.Condition(self._lock)
        self._kept: dict[int, Replay] = {}  # by id(entry): sent to a child, or waiting for the CPU checks
        self._ready: list[Replay] = []
        self._loading: Replay | None = None
        self._asked = False  # the preload thread has a run to do
        self._force = False  # ... also inside a sampling run (someone waits for it)
        self._thread: threading.Thread | None = None
        self.loaded: list[dict] = []  # one record per kind loaded, for stats

    def keep(self, capture) -> None:
        """Remember `capture` (what a child compiles its kind from, or a kind found in the cache's calls here),
        to replay it once the child is done (the CPU checks are). Its block is then held weakly."""
        if not enabled(capture.entry.device_type) or capture.error:
            return
        replay = Replay(capture, weakref.ref(capture.block))
        capture.block = None
        with self._lock:
            self._kept[id(capture.entry)] = replay

    def kept(self, entry):
        """The capture kept for `entry`, if any (a kind found in the cache notes its calls into it)."""
        replay = self._kept.get(id(entry))
        return None if replay is None else replay.capture

    def child_done(self, entries: list) -> None:
        """The child is done with `entries`: those it compiled load at the next idle moment."""
        self._ready_up([e for e in entries if e.background.state is BackgroundState.DONE])

    def cpu_checks_done(self) -> None:
        """Inductor's CPU checks ran: the kinds found in the cache that waited for them load at the next idle
        moment."""
        with self._lock:
            found = [r.capture.entry for r in self._kept.values()
                     if r.capture.entry.background.state is BackgroundState.NOT_NEEDED]
        self._ready_up(found)

    def _ready_up(self, entries: list) -> None:
        with self._lock:
            self._ready += [self._kept.pop(id(e)) for e in entries if id(e) in self._kept]
            if not self._ready:
                return
        IDLE_GATE.when_idle(self.run)

    def awaited_by(self, entry) -> bool:
        """`entry` has no graph in this process yet and the preload will load its graphs between prompts: until
        then its blocks run eagerly rather than load them in a prompt (Dynamo traces each graph: seconds)."""
        return (entry.compiles == 0 and entry.background.state in LOADABLE and enabled(entry.device_type)
                and entry.choice.path != "eager" and self.will_load(entry))

    def will_load(self, entry) -> bool:
        """Graphs of `entry` are still to load here: kept for its child, ready, or loading now."""
        with self._lock:
            return (id(entry) in self._kept or any(r.capture.entry is entry for r in self._ready)
                    or (self._loading is not None and self._loading.capture.entry is entry))

    @property
    def pending(self) -> list[str]:
        """Kinds still to load, the one loading now first."""
        loading = [self._loading] if self._loading else []
        return [r.capture.entry.kind.label for r in (*loading, *self._ready)]

    def run(self, force: bool = False) -> None:
        """Have the preload thread load the ready kinds, one by one. Without `force` (the idle gate's call) it
        stops when a sampling run starts, and the rest wait for the next idle moment; with `force` (someone waits
        for them) it loads them all, and this returns once they are loaded."""
        with self._changed:
            if not self._ready and self._loading is None:
                return
            self._asked, self._force = True, self._force or force
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="accel-preload", daemon=True)
                self._thread.start()
            self._changed.notify_all()
            if force:
                self._changed.wait_for(lambda: not self._asked and not self._ready and self._loading is None)

    def _serve(self) -> None:
        """The preload thread: never ends (see the module's docstring). Its replays run compiled CPU kernels, which
        give it an OpenMP pool of its own; it gives that back whenever it stops (openmp.py), or the pool would slow
        every parallel region of the sampler's thread."""
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._asked)
                self._asked = False
            while True:
                with self._changed:
                    if not self._ready:
                        self._force = False
                        release_this_threads_pool()  # before anyone waiting for the preload samples
                        self._changed.notify_all()
                        break
                    if not self._force and IDLE_GATE.sampling:
                        IDLE_GATE.when_idle(self.run)
                        release_this_threads_pool()
                        self._changed.notify_all()
                        break
                    replay = self._loading = self._ready.pop(0)
                try:
                    self._load(replay)
                finally:
                    with self._changed:
                        self._loading = None

    def _load(self, replay: Replay) -> None:
        capture, block = replay.capture, replay.block()
        entry = capture.entry
        if block is None or entry.background.state not in LOADABLE:
            return
        start = time.perf_counter()
        try:
            with ACTIVITY.running("a preload of compiled graphs"):  # tracing: no timing is taken beside it
                frames = entry.preload(block, list(capture.calls), capture.grad, capture.inference)
        except Exception as err:  # noqa: BLE001  (the kind loads at its next call instead, as without this)
            log.info("[Accel] Compile Model: loading %s between prompts failed (%s: %s); it loads at its next "
                     "call", entry.kind.label, type(err).__name__, str(err)[:200])
            return
        seconds = time.perf_counter() - start
        entry.background.preloaded(seconds)
        self.loaded.append({"kind": entry.kind.label, "frames": frames, "seconds": round(seconds, 2)})
        log.info("[Accel] Compile Model: loaded %s between prompts in %.1f s", entry.kind.label, seconds)
        telemetry.record("compile_model", "preloaded", kind=entry.kind.label, seconds=round(seconds, 2))

    def stats(self) -> dict:
        return {"pending": self.pending, "loaded": list(self.loaded[-20:])}


PRELOADER = Preloader()
