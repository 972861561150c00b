"""What the DeepCache node asked for, validated when the node runs (not in the middle of sampling)."""
from __future__ import annotations

from dataclasses import dataclass

from .adaptive import DEFAULT_THRESHOLD, AdaptivePolicy
from .schedule import ADAPTIVE, ADAPTIVE_MIN_STEPS, SCHEDULES


@dataclass(frozen=True)
class DeepCacheConfig:
    interval: int = 3
    depth: int = 0
    start_percent: float = 0.0
    end_percent: float = 1.0
    schedule: str = "uniform"
    threshold: float = DEFAULT_THRESHOLD  # adaptive only: the change of the signal under which a step reuses
    owner: str | None = None  # who applied it (the web UI's node id), named in its run reports; changes nothing

    def __post_init__(self):
        if self.interval < 1:
            raise ValueError("cache interval must be at least 1")
        if self.depth < 0:
            raise ValueError("cache depth must be 0 or more")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}")
        self.policy()  # a bad threshold fails here, when the node runs, not in the middle of sampling

    def policy(self) -> AdaptivePolicy:
        """Adaptive mode's rule: the threshold, and at most interval - 1 reused steps in a row."""
        return AdaptivePolicy(threshold=self.threshold, max_reused=self.interval - 1)


def schedule_text(config: DeepCacheConfig) -> str:
    if config.schedule == ADAPTIVE:
        return (f"adaptive schedule (threshold {config.threshold:g}, at most {config.interval - 1} reused steps in "
                f"a row, runs under {ADAPTIVE_MIN_STEPS} steps left alone)")
    return f"{config.schedule} schedule"
