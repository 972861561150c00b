"""DeepCache's `auto` schedule (the node's default): the settings measured best against core ComfyUI's caches for
the kind of model the node sees, chosen when the node runs. Pure: the model's classes in, a config out.

Each preset is the point of the digits models' quality-speed fronts (docs/benchmarks/deepcache_front.md) that was
at least as fast as core LazyCache's and EasyCache's defaults at a better mean PSNR on that kind of model (on the
video model not in every run, and with a worse worst frame than LazyCache's: that file says by how much):
- a UNet (SD1.5, SDXL): the adaptive schedule at threshold 0.3, at most 5 reused steps in a row, the reused
  deep feature forecast along the line through the last two full steps' ("linear": a UNet's signal is its input
  latent, along which "fitted" gives what "linear" gives);
- an image transformer (Flux, SD3, Qwen-Image, Chroma): adaptive 0.3, every block after the first reused
  ("first only"), the reused residual forecast as far as the signal moved ("fitted"), at most 5 in a row;
- a video transformer (Wan, HunyuanVideo, LTX-Video): the same at threshold 0.5.
All are adaptive, so a run of fewer than schedule.ADAPTIVE_MIN_STEPS steps (few-step distilled models) reuses
nothing and equals full compute.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..families import VIDEO_DIT_CLASSES
from .schedule import ADAPTIVE

AUTO = "auto"
UNET, IMAGE_DIT, VIDEO_DIT = "UNet", "image transformer", "video transformer"


@dataclass(frozen=True)
class Preset:
    interval: int
    threshold: float
    forecast: str = "off"
    live_blocks: str = "first and last"
    signal: str = "deep input"


PRESETS = {
    UNET: Preset(interval=6, threshold=0.3, forecast="linear"),
    IMAGE_DIT: Preset(interval=6, threshold=0.3, forecast="fitted", live_blocks="first only"),
    VIDEO_DIT: Preset(interval=6, threshold=0.5, forecast="fitted", live_blocks="first only"),
}


def model_kind(diffusion_model, is_transformer: bool) -> str:
    if not is_transformer:
        return UNET
    names = {cls.__name__ for cls in type(diffusion_model).__mro__}
    return VIDEO_DIT if names.intersection(VIDEO_DIT_CLASSES) else IMAGE_DIT


def resolve(config, kind: str):
    """`config` with the auto schedule replaced by `kind`'s preset (its interval, threshold, forecast, live blocks
    and signal; depth, start and end percent stay the node's), or `config` itself for any other schedule."""
    if config.schedule != AUTO:
        return config
    return dataclasses.replace(config, schedule=ADAPTIVE, preset=kind, **dataclasses.asdict(PRESETS[kind]))
