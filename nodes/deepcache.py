from __future__ import annotations

from ..accel import deepcache, telemetry
from .common import CATEGORY, OWNER_INPUTS, log, status_owner


class DeepCache:
    DISPLAY_NAME = "DeepCache (Accel)"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Reuses deep features across sampling steps: a UNet's deep skip-branch feature, or a transformer's "
                   "(Flux, Chroma, SD3, Wan, HunyuanVideo, Qwen-Image, LTX-Video) middle blocks' residual, so that "
                   "reused steps run only the outer blocks. Which steps reuse: a fixed schedule, or adaptive (each step "
                   "decides from how much the features moved). Its state is created for each sampling run and "
                   "dropped after it, so nothing carries over between prompts.")
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model (a UNet or a transformer) whose sampling steps "
                                           "reuse deep features."}),
            "cache_interval": ("INT", {"default": 3, "min": 1, "max": 1000,
                                       "tooltip": "uniform / non-uniform: one full step in every cache_interval "
                                                  "steps; adaptive: at most cache_interval - 1 reused steps in a "
                                                  "row. 1 = full compute every step (no caching); higher = faster, "
                                                  "further from full compute."}),
            "cache_depth": ("INT", {"default": 0, "min": 0, "max": 12,
                                    "tooltip": "UNet: which skip branch stays live; 0 is the shallowest. Transformer: "
                                               "how many blocks beyond the first and last stay live at each end."}),
            "start_percent": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                        "tooltip": "Where in the sampling schedule reuse may begin (0 = from the "
                                                   "first step); steps before it run in full."}),
            "end_percent": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                      "tooltip": "Where in the sampling schedule reuse ends (1 = to the last "
                                                 "step); steps after it run in full."}),
            "schedule": ([deepcache.AUTO, *deepcache.SCHEDULES], {
                "default": deepcache.AUTO,
                "tooltip": "auto: the settings measured best for the model's kind (UNet: adaptive 0.3, linear "
                           "forecast; image transformer: adaptive 0.3, first only, fitted forecast; video "
                           "transformer: the same at 0.5); it sets cache_interval, threshold, forecast, live_blocks and signal, and runs of "
                           "8 steps or fewer are left alone. uniform: one full step in cache_interval. "
                           "non-uniform: as many, denser early. adaptive: each step decides from how much the "
                           "features moved since the last full step (threshold), at most cache_interval - 1 "
                           "reused steps in a row; runs of 8 steps or fewer are left alone."}),
        }, "optional": {
            "threshold": ("FLOAT", {"default": deepcache.DEFAULT_THRESHOLD, "min": 0.0, "max": 10.0, "step": 0.01,
                                    "tooltip": "adaptive only: a step reuses while the deep part's input changed "
                                               "by less than this share (0.2 = 20 %) since the last full step. "
                                               "0 = never reuse; higher = faster, further from full compute."}),
            "forecast": (list(deepcache.FORECASTS), {
                "default": "off",
                "tooltip": "What a reused step adds for the skipped work. off: the last full step's feature as it "
                           "is. linear: the line through the last two full steps' features, taken at this step "
                           "(closer to full compute at the same speed, most of all with few full steps; keeps one "
                           "more feature in memory). fitted (adaptive schedule): the same line, taken only as far "
                           "as the deep part's input moved along its own last change (closer still on "
                           "transformers; on UNets about what linear gives). quadratic: the parabola through the "
                           "last three full steps' features (a second-order forecast; keeps two more features)."}),
            "live_blocks": (list(deepcache.LIVE_BLOCKS), {
                "default": "first and last",
                "tooltip": "Transformers: which blocks run on a reused step. first and last: the first and last "
                           "(plus cache_depth more at each end). first only: the first (plus cache_depth more); "
                           "everything after it is reused, so a reused step costs about one block: faster, "
                           "further from full compute (pair it with forecast fitted or linear). UNets: no effect."}),
            "signal": (list(deepcache.SIGNALS), {
                "default": "deep input",
                "tooltip": "adaptive, transformers: what the threshold is compared with. deep input: how far the "
                           "input of the reused blocks moved since the last full step. first block residual: how "
                           "far what the first blocks added moved (First Block Cache's rule, thresholds about "
                           "0.08 to 0.12). UNets: their input latent either way."}),
        }, "hidden": OWNER_INPUTS}

    def apply(self, model, cache_interval, cache_depth, start_percent, end_percent, schedule,
              threshold=deepcache.DEFAULT_THRESHOLD, forecast="off", live_blocks="first and last",
              signal="deep input", unique_id=None, extra_pnginfo=None):
        options = dict(cache_interval=cache_interval, cache_depth=cache_depth, start_percent=start_percent,
                       end_percent=end_percent, schedule=schedule, threshold=threshold, forecast=forecast,
                       live_blocks=live_blocks, signal=signal)
        config = deepcache.DeepCacheConfig(interval=cache_interval, depth=cache_depth, start_percent=start_percent,
                                           end_percent=end_percent, schedule=schedule, threshold=threshold,
                                           forecast=forecast, live_blocks=live_blocks, signal=signal,
                                           owner=status_owner(unique_id, extra_pnginfo))
        patched, depth, message = deepcache.apply(model, config)
        if patched is None:
            telemetry.record(deepcache.FEATURE, "unsupported", options=options, reason=message, node=config.owner)
            log.warning("[Accel] %s: %s; the model passes through unchanged.", self.DISPLAY_NAME, message)
            return (model.clone(),)
        telemetry.record(deepcache.FEATURE, "applied", options=options, depth=depth, node=config.owner)
        log.info("[Accel] %s: %s.", self.DISPLAY_NAME, message)
        return (patched,)
