"""Minor page faults per sampling step, for GET /accel/stats: the process tax made visible where it is paid.

A step that allocates a large CPU tensor in fresh pages every call (ComfyUI's `cond_cat`: 617 pages of 2.5 MB)
takes hundreds of minor faults a step; a step that reuses heap memory takes a few. The count comes from
getrusage around each step of a sampling run of a Compile Model model: the OUTER_SAMPLE wrapper (compile's
patcher.py) hands the run's step callback through `counted_run`, which reads the counters at the run's start
and at each callback (ComfyUI calls it once a step, after the step). A run given no callback is counted whole
(its steps are not told apart): a callback is never added where ComfyUI had none.
"""
from __future__ import annotations

import itertools
import resource
import statistics
import threading
import time

# CFGGuider.outer_sample(noise, latent_image, sampler, sigmas, denoise_mask, callback, ...), the OUTER_SAMPLE
# executor's arguments, the same in ComfyUI 0.3.75 and 0.33.0
CALLBACK_POSITION = 5
RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only


def _faults() -> tuple[int, int | None]:
    process = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    thread = resource.getrusage(RUSAGE_THREAD).ru_minflt if RUSAGE_THREAD is not None else None
    return process, thread


class StepFaults:
    """The last sampling run's faults per step (process-wide, and in the sampling thread alone)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict | None = None

    def counted_run(self, executor, args: tuple, kwargs: dict):
        marks = [_faults()]
        thread = threading.current_thread()

        def mark() -> None:
            if threading.current_thread() is thread:  # the thread counter is this thread's
                marks.append(_faults())

        args, kwargs = list(args), dict(kwargs)
        original = args[CALLBACK_POSITION] if len(args) > CALLBACK_POSITION else kwargs.get("callback")
        # only a callable is wrapped: were the argument order ever to change, what sits there is left as it is
        # and the run is counted whole (docs/comfyui_compat.md: the OUTER_SAMPLE executor's arguments)
        stepped = callable(original)
        if stepped:
            def callback(*a, **k):
                mark()
                return original(*a, **k)

            if len(args) > CALLBACK_POSITION:
                args[CALLBACK_POSITION] = callback
            else:
                kwargs["callback"] = callback
        try:
            return executor(*args, **kwargs)
        finally:
            end = _faults()
            if not stepped:
                marks.append(end)
            self._note(marks, stepped, thread.name, end)

    def _note(self, marks: list, stepped: bool, thread_name: str, end: tuple) -> None:
        process = [b[0] - a[0] for a, b in itertools.pairwise(marks)]
        in_thread = [b[1] - a[1] for a, b in itertools.pairwise(marks)] if marks[0][1] is not None else None
        record = {"time": time.time(), "thread": thread_name, "steps_counted": len(process), "per_step": process,
                  "median_per_step": statistics.median(process) if process else None,
                  "steady_median_per_step": statistics.median(process[1:]) if len(process) > 1 else None,
                  "max_per_step": max(process) if process else None,
                  "sampling_thread_per_step": in_thread, "whole_run": end[0] - marks[0][0],
                  "by_step": stepped}
        with self._lock:
            self._last = record

    def last(self) -> dict | None:
        with self._lock:
            return None if self._last is None else dict(self._last)


STEP_FAULTS = StepFaults()
