"""Which steps of a sampling run compute the whole model ("full") and which reuse the deep features ("shallow").

Pure Python over the run's sigma schedule, decided before the first step: nothing here runs inside a model
call, so the decision can never end up inside a compiled graph. The uniform and non-uniform schedules fix every
step here; the adaptive one fixes the steps that must be full and leaves the others to adaptive.py, which
decides each of them in its step from what the model computes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("uniform", "non-uniform", "adaptive")
ADAPTIVE = "adaptive"
# Adaptive mode leaves runs this short alone: few-step (distilled) models change a lot at every step, and one
# reused step is a large share of their compute and of their picture. The fixed schedules do as the user set.
ADAPTIVE_MIN_STEPS = 9

# Non-uniform spacing as in the DeepCache paper's SD example (50 steps, center 15, power 1.4): full steps are
# densest around 30 % of the caching window, where the paper measures the deep features changing fastest,
# and sparser towards its ends.
NONUNIFORM_CENTER = 0.3
NONUNIFORM_POWER = 1.4


@dataclass(frozen=True)
class StepPlan:
    """The plan for one run: `full[i]` for step i, and `source[i]`, the full step whose features step i reuses."""

    sigmas: tuple[float, ...]  # the sigma each step evaluates the model at (the schedule without its last entry)
    full: tuple[bool, ...]  # adaptive: the steps that must be full; the others are decided in their step
    adaptive: bool = False

    @property
    def steps(self) -> int:
        return len(self.full)

    @property
    def shallow_steps(self) -> int:
        return self.full.count(False)

    def source(self, step: int) -> int | None:
        """The latest full step before `step` (whose cached features a shallow `step` reads)."""
        for i in range(step - 1, -1, -1):
            if self.full[i]:
                return i
        return None

    def is_shallow(self, step: int | None) -> bool:
        return step is not None and 0 <= step < self.steps and not self.full[step]

    def cache_needed_after(self, step: int) -> bool:
        """Whether a shallow step follows `step`, i.e. whether features computed now will ever be read."""
        return any(not f for f in self.full[step + 1:])

    def step_of(self, sigma: float, previous: int | None) -> int | None:
        """The step evaluated at `sigma`, matched against the schedule (relative tolerance 1e-4, as ComfyUI's
        context windows do), from the current step `previous` on first: custom sigmas may come back to a sigma
        (a restart schedule), and the step is then the later one. A sigma that is not in the schedule is a
        sampler's sub-step (heun, dpm_2, ...): it belongs to the current step, `previous`."""
        start = previous or 0
        for i in [*range(start, len(self.sigmas)), *range(start)]:
            if math.isclose(self.sigmas[i], sigma, rel_tol=1e-4, abs_tol=0.0):
                return i
        return previous


def full_steps_nonuniform(length: int, n_full: int, center: float = NONUNIFORM_CENTER,
                          power: float = NONUNIFORM_POWER) -> list[int]:
    """`n_full` distinct step offsets in [0, length), always including 0, spaced as c + sign(u)|u|^power
    for u evenly spaced: dense near `center` (a fraction of the window), sparse away from it. The power is
    lowered towards 1 (uniform spacing) until rounding leaves `n_full` distinct steps."""
    if n_full >= length:
        return list(range(length))
    c = center * (length - 1)
    p = power
    while p > 1.0:
        lo, hi = -(c ** (1 / p)), (length - 1 - c) ** (1 / p)
        offsets = set()
        for k in range(n_full):
            u = lo + (hi - lo) * k / max(n_full - 1, 1)
            offsets.add(min(length - 1, max(0, round(c + math.copysign(abs(u) ** p, u)))))
        if len(offsets) == n_full and 0 in offsets:
            return sorted(offsets)
        p -= 0.02
    return sorted({round(k * (length - 1) / max(n_full - 1, 1)) for k in range(n_full)})


def make_plan(schedule_sigmas, interval: int, schedule: str, start_sigma: float, end_sigma: float) -> StepPlan:
    """Plan a run over `schedule_sigmas` (the run's sigmas, last entry the end point).

    Caching is allowed on steps whose sigma lies in (end_sigma, start_sigma] (ComfyUI's start/end percent,
    converted by the model's own model_sampling). Inside that window the first step is full and then one in
    `interval` steps is full (uniform), or the same number of full steps is spread non-uniformly. Steps
    outside the window are full. Adaptive: the window's first step and the run's last step are full, and so
    is every step of a run shorter than ADAPTIVE_MIN_STEPS; each other step of the window may reuse.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    sigmas = tuple(float(s) for s in schedule_sigmas)[:-1]
    full = [True] * len(sigmas)
    window = [i for i, s in enumerate(sigmas) if end_sigma < s <= start_sigma]
    if schedule == ADAPTIVE:
        if interval > 1 and len(sigmas) >= ADAPTIVE_MIN_STEPS:
            for i in window[1:]:
                full[i] = False
            full[-1] = True
        return StepPlan(sigmas=sigmas, full=tuple(full), adaptive=True)
    if interval > 1 and window:
        # The window is contiguous for any monotone schedule; take its span so a stray repeated sigma cannot split it.
        first, length = window[0], window[-1] - window[0] + 1
        n_full = math.ceil(length / interval)
        if schedule == "uniform":
            offsets = range(0, length, interval)
        else:
            offsets = full_steps_nonuniform(length, n_full)
        for i in range(first, first + length):
            full[i] = False
        for k in offsets:
            full[first + k] = True
    return StepPlan(sigmas=sigmas, full=tuple(full))
