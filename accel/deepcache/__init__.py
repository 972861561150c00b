"""DeepCache for ComfyUI models: reuse deep features across sampling steps.

- `schedule`: which steps are full and which shallow, planned per run from the run's sigma schedule.
- `unet_paths`: the full path (ComfyUI's forward, deep feature captured) and the shallow path on a UNetModel,
  and the FLOP estimate of the shallow path's share.
- `dit_paths`: on a transformer, the middle blocks' residual captured on full steps and added instead of them on
  reused ones, through ComfyUI's per-block replace patches.
- `adaptive`: adaptive mode's signal and rule, decided per step and cond chunk.
- `config`: what the node asked for, validated.
- `presets`: the auto schedule's settings for each kind of model (UNet, image and video transformer).
- `run_state`: one sampling run's state, and the one decision per model call both paths act on.
- `runtime`: the wrappers (OUTER_SAMPLE, and the UNet's and the transformer's per-call ones) and `apply()`.
"""
from .adaptive import DEFAULT_THRESHOLD
from .config import FORECASTS, LIVE_BLOCKS, SIGNALS, DeepCacheConfig
from .presets import AUTO
from .run_state import FEATURE, few_steps_text
from .runtime import apply
from .schedule import SCHEDULES

__all__ = ["AUTO", "DEFAULT_THRESHOLD", "FEATURE", "FORECASTS", "LIVE_BLOCKS", "DeepCacheConfig", "SCHEDULES",
           "SIGNALS", "apply", "few_steps_text"]
