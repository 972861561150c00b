"""Adaptive mode: a step that may reuse (schedule.py leaves it open) decides in that step, per cond chunk, from
how far a tensor the step computes anyway has moved since that chunk's last full step.

The signal, per cond chunk, is the relative L1 change `mean|x - x_full| / mean|x_full|` of:
- on a transformer, the input of the first skipped span: the output of the first live blocks (image tokens after
  the timestep's modulation and, in double-stream blocks, the text's attention), measured in the block loop
  before the span would run (dit_paths.py);
- on a UNet, the model call's input latent (its first block is a convolution of it), measured before the call
  (runtime.py). ComfyUI gives every cond chunk of a step the same latent, so every chunk decides alike and cond
  and uncond give the same result batched or split.

Measured against the last full step, the change accumulates over the reused steps by itself: no per-model
calibration, one threshold a user can reason about ("reuse while the deep features' input moved less than 20 %").
A chunk reuses while that change stays under the threshold and it has reused fewer than `max_reused` steps in a
row (the node's interval minus one). The plan keeps the window's first step and the run's last step full.

The decision is plain Python on two scalars per chunk (a host sync each), outside any compiled graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# 20 % of the deep part's input moved since the last full step; where TeaCache's accumulated thresholds for Flux
# start (0.25 for 1.5x). Not calibrated on real weights here (no weights can be downloaded): a starting point.
DEFAULT_THRESHOLD = 0.2


def relative_change(x: torch.Tensor, reference: torch.Tensor) -> float:
    """mean |x - reference| / mean |reference| (in float32; 0 for a reference of zeros that x equals)."""
    ref = reference.float()
    moved = (x.float() - ref).abs().mean()
    scale = ref.abs().mean()
    return float((moved / scale).item()) if scale > 0 else (0.0 if moved == 0 else float("inf"))


def progress_along(x: torch.Tensor | None, reference, previous, limit: float) -> float:
    """Forecast "fitted": how far the signal `x` moved from its last full step's `reference` along its own last
    change (`reference` - `previous`, the full step before), as a share of that change: the least-squares factor
    a of x - reference = a (reference - previous). The deep features are then taken that far along their own last
    change: measured at this step, where a line in sigma assumes the change goes on at the same pace (on the
    trained video Wan the signal covered a third to three fifths of what that line foresaw). Kept within
    [0, limit], the line's own factor: a signal that moved back gives no direction (the feature is held), and one
    that ran ahead of the line does not take the features further than the line would (a UNet's input latent
    does: there fitted gives linear). 0 without a signal or a change."""
    if x is None or reference is None or previous is None or not x.shape == reference.shape == previous.shape:
        return 0.0
    change = _flat32(reference) - _flat32(previous)
    moved = _flat32(x) - _flat32(reference)
    along, norm = torch.stack((torch.dot(moved, change), torch.dot(change, change))).tolist()  # one sync
    if not norm > 0:  # also NaN
        return 0.0
    factor = along / norm
    return 0.0 if math.isnan(factor) else min(max(factor, 0.0), limit)  # NaN: held


def _flat32(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).float()  # float32 sums (fp16 overflows); no copy for a contiguous float32 tensor


@dataclass(frozen=True)
class AdaptivePolicy:
    threshold: float = DEFAULT_THRESHOLD
    max_reused: int = 2  # steps in a row one chunk may reuse

    def __post_init__(self):
        if not self.threshold >= 0:  # also refuses NaN
            raise ValueError(f"the adaptive threshold must be 0 or more, not {self.threshold!r}")

    def reuses(self, change: float, reused_in_row: int) -> bool:
        return reused_in_row < self.max_reused and change < self.threshold


@dataclass
class AdaptiveCall:
    """One model call's decision: the chunks' references (the signal at their last full step) and how many steps
    each reused since; `decide` measures the signal once and fixes `reuse`, one flag per chunk."""

    policy: AdaptivePolicy
    references: list  # per chunk: the signal at its last full step
    reused_in_row: list  # per chunk
    reuse: tuple | None = None
    changes: list = field(default_factory=list)

    def decide(self, signal: torch.Tensor | None) -> tuple:
        if self.reuse is None:
            parts = signal.chunk(len(self.references)) if signal is not None else ()
            if len(parts) != len(self.references) or any(p.shape != r.shape for p, r in zip(parts, self.references)):
                self.reuse = (False,) * len(self.references)  # another shape than the full step's: run it
            else:
                self.changes = [relative_change(p, r) for p, r in zip(parts, self.references)]
                self.reuse = tuple(self.policy.reuses(c, n) for c, n in zip(self.changes, self.reused_in_row))
        return self.reuse

    @property
    def mixed(self) -> bool:
        return self.reuse is not None and any(self.reuse) and not all(self.reuse)
