"""What the DeepCache node asked for, validated when the node runs (not in the middle of sampling)."""
from __future__ import annotations

from dataclasses import dataclass

from .adaptive import DEFAULT_THRESHOLD, AdaptivePolicy
from .presets import AUTO
from .schedule import ADAPTIVE, ADAPTIVE_MIN_STEPS, SCHEDULES

# What a reused step adds for the skipped work: the feature of the last full step as it is ("off", DeepCache's
# own rule), or extrapolated from the last two full steps ("linear": along the line in sigma, a first-order
# forecast as TaylorSeer does; "fitted", adaptive only: along the same line, as far as the adaptive signal
# measured at this step moved along its own last change, adaptive.progress_along). Both keep one more feature
# per cond chunk. "quadratic": the parabola in sigma through the last three full steps' features, taken at this
# step's sigma (a second-order forecast: TaylorSeer's order 2, from finite differences); keeps two more features
# per cond chunk, and a step with fewer than three full steps behind it gets the line, or the feature as it is.
FORECASTS = ("off", "linear", "fitted", "quadratic")
# Transformers: which end blocks run on a reused step. "first and last": DeepCache's split (the last block
# refines the reused residual); "first only": everything after the first block(s) is reused, as First Block Cache
# does, so a reused step costs one block. UNets keep their own split (cache_depth's skip branch).
LIVE_BLOCKS = ("first and last", "first only")
# Adaptive mode's signal on a transformer (adaptive.py): "deep input", the input of the skipped span (the live
# first blocks' output); "first block residual", what the live first blocks added to their input (their output
# minus their input), First Block Cache's signal: it leaves out the part of the tokens the blocks pass through,
# so it moves more from step to step and its thresholds are smaller (its users run 0.07 to 0.12). UNets keep
# their input latent.
SIGNALS = ("deep input", "first block residual")
FIRST_BLOCK_RESIDUAL = "first block residual"


@dataclass(frozen=True)
class DeepCacheConfig:
    interval: int = 3
    depth: int = 0
    start_percent: float = 0.0
    end_percent: float = 1.0
    schedule: str = "uniform"
    threshold: float = DEFAULT_THRESHOLD  # adaptive only: the change of the signal under which a step reuses
    forecast: str = "off"
    live_blocks: str = "first and last"  # transformers only
    signal: str = "deep input"  # adaptive, transformers only
    owner: str | None = None  # who applied it (the web UI's node id), named in its run reports; changes nothing
    preset: str | None = None  # the kind of model whose preset the auto schedule took (presets.resolve)

    def __post_init__(self):
        if self.interval < 1:
            raise ValueError("cache interval must be at least 1")
        if self.depth < 0:
            raise ValueError("cache depth must be 0 or more")
        for name in ("start_percent", "end_percent"):
            if not 0.0 <= getattr(self, name) <= 1.0:  # NaN too, which a prompt's JSON may carry
                raise ValueError(f"{name} must be between 0 and 1, not {getattr(self, name)}")
        if self.schedule not in (AUTO, *SCHEDULES):
            raise ValueError(f"schedule must be one of {(AUTO, *SCHEDULES)}, not {self.schedule!r}")
        if self.forecast not in FORECASTS:
            raise ValueError(f"forecast must be one of {FORECASTS}, not {self.forecast!r}")
        if self.forecast == "fitted" and self.schedule not in (ADAPTIVE, AUTO):  # auto sets its own forecast
            raise ValueError(f'forecast "fitted" follows the adaptive schedule\'s signal, which the {self.schedule} '
                             'schedule does not measure: set schedule to adaptive, or forecast to linear')
        if self.live_blocks not in LIVE_BLOCKS:
            raise ValueError(f"live_blocks must be one of {LIVE_BLOCKS}, not {self.live_blocks!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {SIGNALS}, not {self.signal!r}")
        if self.signal != SIGNALS[0] and self.schedule not in (ADAPTIVE, AUTO):
            raise ValueError(f'signal "{self.signal}" is what the adaptive schedule measures, which the '
                             f'{self.schedule} schedule does not: set schedule to adaptive, or signal to deep input')
        self.policy()  # a bad threshold fails here, when the node runs, not in the middle of sampling

    def policy(self) -> AdaptivePolicy:
        """Adaptive mode's rule: the threshold, and at most interval - 1 reused steps in a row."""
        return AdaptivePolicy(threshold=self.threshold, max_reused=self.interval - 1)


def schedule_text(config: DeepCacheConfig) -> str:
    forecast = {"linear": ", features forecast linearly from the last two full steps",
                "quadratic": ", features forecast from the last three full steps (second order)",
                "fitted": ", features forecast from the last two full steps as far as the signal moved"}.get(
        config.forecast, "")
    if config.preset is not None:
        forecast += (f" (auto: the {config.preset} preset, which sets the interval, threshold, forecast, live "
                     "blocks and signal)")
    if config.schedule == ADAPTIVE:
        signal = ", signal: the first blocks' residual" if config.signal == FIRST_BLOCK_RESIDUAL else ""
        return (f"adaptive schedule (threshold {config.threshold:g}{signal}, at most {config.interval - 1} reused "
                f"steps in a row, runs under {ADAPTIVE_MIN_STEPS} steps left alone){forecast}")
    return f"{config.schedule} schedule{forecast}"
