"""The ComfyUI process's side of the background compiler: captures, jobs, one child at a time.

choose="auto": when a kind must be compiled and the persistent cache holds nothing for it, the sampler's call
goes on eagerly and one block of that kind is captured with the layouts of its call's inputs. After the call, a
child process (`python -m accel compile-worker DIR`, compile/child/) compiles the captured kinds into the persistent
compile cache, the same way a compiled call here would, and saves each graph whole as a precompiled function
(precompiled.py). Meanwhile those blocks run eagerly. Once the child is done, this process loads the precompiled
functions at its next idle moment (loader.py): about 0.1 s a kind, no Dynamo tracing
(docs/benchmarks/cold_start.md). Where torch cannot precompile a kind, it compiles again here at its next call,
from torch's on-disk caches.

The child stays for later jobs (one at a time, sent as a job directory per line on its stdin) until it has been
idle for `ACCEL_BACKGROUND_IDLE_SECONDS` (0: one child per job): each new child pays torch's and ComfyUI's imports
and inductor's per-process probe of the CPU's vector instruction sets before its first compile, about 17 s on the
2-core test CPU, which a waiting one has behind it. By default it waits 600 s after a CPU job, and goes at once
after a GPU job: there a waiting child would hold a CUDA context (GPU memory the sampler may need), and it has no
CPU probe to save. This process alone decides when it goes (it closes the child's stdin), so a job is never sent
to a child that is leaving.

On a CPU machine with few cores, a job found during a sampling run is held until this process is idle after
that run (idle_gate.py: the prompt's VAE decode done, ComfyUI waiting for the next prompt): the child's start
(imports and torch's CPU checks, new Python processes) beside the sampler took the sampler's cores and memory
bandwidth even in the idle scheduling class, and beside the decode it made the first prompt 1.25x eager's. The
blocks run eagerly meanwhile, as they would while it compiles. On a GPU, or with more cores, or with
`ACCEL_BACKGROUND_AT_ONCE=1`, it starts at once.

A kind already compiled that meets inputs of a new shape (a longer prompt, another size) would compile again in
the sampler's path: that call is captured too, after the kind's first call's layouts, so the child makes the same
static-then-dynamic graphs this process would, and calls of the new shape run eagerly until it is done.

What cannot be captured (an attribute that does not pickle, a tensor subclass), or a child that fails, sends the
kind back to compiling here at its next call, and the log says why. Each kind's state moves only through its
`KindBackground` (state.py).
"""
from __future__ import annotations

import logging
import pickle
import threading
import time
from pathlib import Path

from ...cache.trust import make_private_dirs
from ..precompiled import warm_loader
from .activity import ACTIVITY
from .capture import Capture
from .cpu_checks import CPU_CHECKS
from .idle_gate import IDLE_GATE
from .job_folders import folder_name, sweep_stale_jobs
from .job_results import hand_back
from .loader import LOADER
from .worker import Job
from .worker_keeper import WorkerKeeper

log = logging.getLogger("comfyui_accel")


class BackgroundCompiler:
    """One job at a time: kinds captured while one runs are sent (as skeletons) to the next, started when it
    ends. Their blocks run eagerly until then. The child they go to, and when it goes, is the `WorkerKeeper`'s
    (worker_keeper.py); reading an ended job's results, job_results.py's."""

    def __init__(self):
        self._lock = threading.Lock()
        self._job: Job | None = None
        self._queue: list[tuple[list[dict], list, Path]] = []  # (items, entries, environment dir) waiting
        self._held: list[tuple[list[dict], list, Path]] = []  # the same, waiting for an idle moment
        # the waiting child: its idle timer retires it only if no job runs or is queued by then
        self._keeper = WorkerKeeper(self._lock, lambda: self._job is None and not self._queue)
        self.history: list[dict] = []  # one record per finished job, for stats
        # Jobs taken off `_job` whose results are still being read (poll, on the loader thread): still busy, so
        # a stats request between the two never sees the work neither running nor finished.
        self._finishing = 0
        self._swept: set[Path] = set()  # environments whose jobs folder was cleared of dead processes' jobs

    @property
    def has_jobs(self) -> bool:
        """A child's job runs, its results are being read, it waits behind the running one, or is held for an idle
        moment."""
        return self._job is not None or self._finishing > 0 or bool(self._queue) or bool(self._held)

    @property
    def busy(self) -> bool:
        """Background work is still to come for this process: a job, kinds waiting for inductor's CPU checks (or
        the checks running). What the demo and the HTTP tests wait on."""
        return self.has_jobs or CPU_CHECKS.busy or bool(LOADER.pending)

    def compiling(self) -> bool:
        """A child works on a job now (its start included): the machine is not the sampler's alone."""
        job = self._job
        return job is not None and not job.ended()

    def launch(self, captures: list[Capture], env_dir: Path, hold: bool = False) -> bool:
        """Send `captures` to a child (now, when the running one ends, or with `hold` at this process's next idle
        moment, idle_gate.py): their kinds become PENDING. False when none could be sent (each such kind compiles
        here at its next call instead, as logged)."""
        items, entries = [], []
        for capture in captures:
            try:
                items.append(capture.job_item())
                entries.append(capture.entry)
            except Exception as err:  # CaptureError, or a block with no tensor to say its device
                capture.entry.background.failed(f"it cannot be sent to a child process ({err})")
        if not items:
            return False
        for entry in entries:
            entry.background.sent()
        if any(item["device"].startswith("cpu") for item in items):
            CPU_CHECKS.want(hold)  # this process loads the child's graphs later: its checks are done by then
        with self._lock:
            if hold:
                self._held.append((items, entries, env_dir))
                IDLE_GATE.when_idle(self.release_held)
                return True
            if self._job is not None:
                self._queue.append((items, entries, env_dir))
                return True
            return self._start(items, entries, env_dir)

    def release_held(self) -> None:
        """Jobs held for an idle moment start (or queue behind the running one)."""
        with self._lock:
            held, self._held = self._held, []
            for job in held:
                if self._job is None:
                    self._start(*job)
                else:
                    self._queue.append(job)

    def _start(self, items: list[dict], entries: list, env_dir: Path) -> bool:
        """Send `items` to the waiting child, or to a new one (the lock held)."""
        self._keeper.cancel_idle_timer()
        if env_dir not in self._swept:
            self._swept.add(env_dir)
            sweep_stale_jobs(env_dir / "jobs")
        directory = env_dir / "jobs" / folder_name("job")
        try:
            make_private_dirs(directory)  # the child unpickles its job: no one else may write there (trust.py)
            with open(directory / "job.pkl", "wb") as handle:
                pickle.dump({"items": items}, handle)
            worker = self._keeper.worker_for(env_dir)
            worker.send(directory)
        except Exception as err:  # whatever it is, it costs the background compile, never the prompt
            for entry in entries:
                entry.background.failed(f"the child process could not start ({err})")
            return False
        self._job = job = Job(entries, worker, directory, time.perf_counter())
        ACTIVITY.started()
        LOADER.watch(self._hand_back_when_done(job))  # on the loader thread: no new thread (and arena) per job
        log.info("[Accel] Compile Model: compiling %s in the background (pid %d); those blocks run eagerly until "
                 "it is done. ACCEL_DISABLE_BACKGROUND_COMPILE=1 compiles them at their first call instead.",
                 ", ".join(e.kind.label for e in entries), worker.process.pid)
        return True

    def retire_idle_worker(self) -> bool:
        """End the waiting child now, if no job runs or waits (before the cache it works in is cleared); False
        when there is background work."""
        with self._lock:
            if self.has_jobs:
                return False
            self._keeper.retire()
            return True

    def _hand_back_when_done(self, job: Job):
        """A check the loader thread makes every quarter second (loader.watch) that hands the job's kinds back when
        it ends, also when no call comes to poll (a server between prompts: the stats then say so at once), but
        never inside a sampling run: there its next call polls, between two calls, so a kind never changes state
        within one. True when there is nothing more to watch."""
        warmed = [job.entries[0].device_type == "cpu"]  # on the CPU the checks' thread warms it, at an idle moment

        def check() -> bool:
            if not warmed[0]:
                warmed[0] = True
                warm_loader()  # the first precompiled function's load then costs the prompt no imports
            if self._job is not job:
                return True
            if not job.ended() or IDLE_GATE.sampling:
                return False
            self.poll()
            return True

        return check

    def poll(self) -> None:
        """If the job has ended, hand its kinds back: cheap enough for every UNet call."""
        job = self._job
        if job is None or not job.ended():
            return
        with self._lock:
            if self._job is not job:
                return
            self._job = None
            self._finishing += 1
        # the child's results are read (and the kinds' graphs queued) on the loader thread, the caller waiting:
        # what that allocates stays out of the prompt thread's arena (loader.py)
        try:
            LOADER.run_here(hand_back, job, self._keeper, self.history)
        finally:
            with self._lock:
                self._finishing -= 1
        with self._lock:  # the next job, for kinds captured while this one ran
            while self._job is None and self._queue:
                self._start(*self._queue.pop(0))
            if self._job is None:
                self._keeper.retire_when_idle(job.entries[0].device_type)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every job (the running one and those queued) is done and its kinds are handed back, and
        kinds found in the cache no longer wait for inductor's CPU checks; False on timeout."""
        IDLE_GATE.release_now()  # whoever waits wants them done, idle or not (held jobs, the CPU checks)
        self.release_held()
        deadline = None if timeout is None else time.perf_counter() + timeout
        if not CPU_CHECKS.wait(timeout):
            return False
        while self._job is not None:
            if deadline is not None and time.perf_counter() > deadline:
                return False
            time.sleep(0.05)
            self.poll()
        LOADER.load_all_now()  # the children's graphs loaded too
        return True

    def stats(self) -> dict:
        self.poll()  # the server's stats route may ask while no UNet call comes to poll
        # Under the lock: release_held empties the held list before _start has made the job, so a snapshot taken
        # between the two would show the work neither held nor running (CI saw exactly that once).
        with self._lock:
            job = self._job
            running = None if job is None else {"pid": job.worker.process.pid,
                                                "kinds": [e.kind.label for e in job.entries],
                                                "seconds": round(time.perf_counter() - job.started, 1)}
            queued = [e.kind.label for _, entries, _ in self._queue for e in entries]
            held = [e.kind.label for _, entries, _ in self._held for e in entries]
        return {"busy": self.busy, "running": running, "queued": queued, "held_until_idle": held,
                "finished": list(self.history), "cpu_checks": CPU_CHECKS.stats(), "loading": LOADER.pending,
                "idle_gate": IDLE_GATE.stats()}


BACKGROUND = BackgroundCompiler()
ACTIVITY.watch("a background compile", BACKGROUND.compiling)
