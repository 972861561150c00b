"""DeepCache on a ComfyUI ModelPatcher: two wrappers and the per-run state they share.

- The OUTER_SAMPLE wrapper runs once per sampling run (each `CFGGuider.sample`: every KSampler, every pass
  of a hires fix or refiner). It plans the run from the run's own sigma schedule, puts a fresh `RunState`
  into the run's copy of the transformer options, and drops it in `finally` (success, error, interrupt).
  This is the pattern of ComfyUI's own EasyCache node.
- The DIFFUSION_MODEL wrapper runs per UNet call. It finds the step from the call's sigma, and runs either
  ComfyUI's own forward (full step, capturing the deep feature) or the shallow path on the cached feature.
  DIFFUSION_MODEL is inside APPLY_MODEL, so blocks compiled by Compile Model from an APPLY_MODEL wrapper
  are in place on both paths, whatever the node order.

Cached features live only in the RunState and are keyed per cond chunk (`uuids`, one per cond/uncond entry,
new for every run), per full step, and by shape, dtype and device; a call that finds no matching feature
does a full step. So cond and uncond, batched or split, a changed batch size or resolution, another
sampler, or a model unloaded between runs cannot read another call's features.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .. import telemetry
from . import unet_paths
from .schedule import SCHEDULES, StepPlan, make_plan

log = logging.getLogger("comfyui_accel")

FEATURE = "deepcache"
WRAPPER_KEY = "accel_deepcache"
RUN_KEY = "accel_deepcache_run"  # the run's RunState, in the run's own copy of transformer_options


@dataclass(frozen=True)
class DeepCacheConfig:
    interval: int = 3
    depth: int = 0
    start_percent: float = 0.0
    end_percent: float = 1.0
    schedule: str = "uniform"

    def __post_init__(self):
        if self.interval < 1:
            raise ValueError("cache interval must be at least 1")
        if self.depth < 0:
            raise ValueError("cache depth must be 0 or more")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}")


@dataclass
class _Entry:
    step: int
    signature: tuple
    h: object  # the deep feature of one cond chunk


@dataclass
class RunState:
    """Everything DeepCache knows during one sampling run; created by the OUTER_SAMPLE wrapper, then dropped."""

    config: DeepCacheConfig
    depth: int
    plan: StepPlan
    features: dict = field(default_factory=dict)  # chunk key (cond uuid) -> _Entry
    step: int | None = None
    full_calls: int = 0
    shallow_calls: int = 0
    fallback_calls: int = 0  # planned shallow, but no matching feature: ran full
    reused_steps: set = field(default_factory=set)
    flops: float = 0.0  # estimated FLOPs of all UNet calls of the run, had they all been full
    skipped_flops: float = 0.0  # the part of it that shallow calls skipped
    estimates: dict = field(default_factory=dict)  # (H, W, context tokens) -> (full, shallow) FLOPs per sample

    def lookup(self, keys, step: int, signature: tuple):
        """The cached deep feature for every chunk of this call, or None. A feature is valid if it was computed
        at this step's source full step or later (a fallback full step refreshes it), and for the same shape."""
        source = self.plan.source(step)
        found = []
        for key in keys:
            entry = self.features.get(key)
            if entry is None or source is None or not source <= entry.step <= step or entry.signature != signature:
                return None
            found.append(entry.h)
        return found

    def store(self, keys, step: int, signature: tuple, h) -> None:
        for i, chunk in enumerate(h.chunk(len(keys))):
            self.features[keys[i]] = _Entry(step, signature, chunk)

    def account(self, unet, x, context, shallow: bool) -> None:
        """Add this call's estimated compute (once per shape: a walk over the UNet's modules, no tensor work)."""
        tokens = context.shape[1] if context is not None and context.dim() > 2 else 1
        key = (tuple(x.shape[2:]), tokens)
        if key not in self.estimates:
            h, w = (x.shape[-2], x.shape[-1]) if x.dim() >= 4 else (1, 1)
            self.estimates[key] = unet_paths.compute_estimate(unet, self.depth, h, w, tokens)
        if self.estimates[key] is None:
            return
        full, shallow_path = self.estimates[key]
        self.flops += x.shape[0] * full
        if shallow:
            self.skipped_flops += x.shape[0] * (full - shallow_path)

    def report(self, status: str) -> dict:
        known = [e for e in self.estimates.values() if e is not None]
        return {
            "status": status, "steps": self.plan.steps, "planned_shallow_steps": self.plan.shallow_steps,
            "reused_steps": len(self.reused_steps), "full_calls": self.full_calls,
            "shallow_calls": self.shallow_calls, "fallback_calls": self.fallback_calls,
            "shallow_share": round(known[0][1] / known[0][0], 4) if known else None,
            "compute_skipped": round(self.skipped_flops / self.flops, 4) if self.flops else None,
            "estimate": "FLOPs of convolutions, linear layers and attention matmuls",
            "interval": self.config.interval, "depth": self.depth, "schedule": self.config.schedule,
        }


def chunk_keys(transformer_options: dict, batch: int):
    """One key per cond chunk of this call: ComfyUI's per-cond `uuids` (new for every run), or failing that
    the cond/uncond index. None when the call cannot be split into chunks (then it is never served from cache)."""
    for name in ("uuids", "cond_or_uncond"):
        keys = transformer_options.get(name)
        if keys and batch % len(keys) == 0 and len(set(keys)) == len(keys):
            return [(name, k) for k in keys]
    return None


def start_run(config: DeepCacheConfig, depth: int, sigmas, model_sampling) -> RunState:
    """A fresh RunState for a run over `sigmas` (the run's schedule, as ComfyUI passes it to OUTER_SAMPLE and
    puts into transformer_options["sample_sigmas"]). Percents become sigmas through the model's own sampling."""
    start = model_sampling.percent_to_sigma(config.start_percent)
    end = model_sampling.percent_to_sigma(config.end_percent)
    plan = make_plan(sigmas.tolist() if hasattr(sigmas, "tolist") else sigmas, config.interval, config.schedule,
                     start, end)
    return RunState(config=config, depth=depth, plan=plan)


class OuterSampleWrapper:
    """OUTER_SAMPLE: one RunState per sampling run, dropped when the run ends however it ends."""

    def __init__(self, config: DeepCacheConfig, depth: int):
        self.config, self.depth = config, depth

    def __call__(self, executor, *args, **kwargs):
        import comfy.model_patcher

        guider = executor.class_obj
        sigmas = args[3] if len(args) > 3 else kwargs["sigmas"]
        run = start_run(self.config, self.depth, sigmas, guider.model_patcher.get_model_object("model_sampling"))
        original = guider.model_options
        # The run's own copy (as EasyCache does): the node's model_options, shared by every run, stay untouched.
        guider.model_options = comfy.model_patcher.create_model_options_clone(original)
        guider.model_options.setdefault("transformer_options", {})[RUN_KEY] = run
        status = "error"
        try:
            result = executor(*args, **kwargs)
            status = "completed"
            return result
        except BaseException as exc:
            status = "interrupted" if "Interrupt" in type(exc).__name__ else "error"
            raise
        finally:
            guider.model_options = original
            run.features.clear()  # drop the cached tensors now, not when the guider is collected
            report_run(run.report(status))


def report_run(report: dict) -> None:
    telemetry.record(FEATURE, "run", **report)
    share, skipped = report["shallow_share"], report["compute_skipped"]
    log.info("[Accel] DeepCache: deep features reused on %d of %d steps (%d shallow UNet calls, %d full%s); "
             "%s of UNet compute skipped (FLOP estimate; the shallow path is %s of a full call). Run %s.",
             report["reused_steps"], report["steps"], report["shallow_calls"], report["full_calls"],
             f", {report['fallback_calls']} full for lack of a matching feature" if report["fallback_calls"] else "",
             f"about {100 * skipped:.0f}%" if skipped is not None else "an unknown share",
             f"{100 * share:.1f}%" if share is not None else "unknown", report["status"])


class DiffusionModelWrapper:
    """DIFFUSION_MODEL: full or shallow UNet call, decided in plain Python from the run's plan."""

    def __init__(self, depth: int):
        self.depth = depth

    def __call__(self, executor, *args, **kwargs):
        # UNetModel.forward calls the executor as (x, timesteps, context, y, control, transformer_options, **kw).
        transformer_options = args[5] if len(args) > 5 else kwargs.get("transformer_options", {})
        run = transformer_options.get(RUN_KEY)
        if run is None:
            return executor(*args, **kwargs)  # a call outside a sampling run (no plan, no cache)
        x = args[0]
        context = args[2] if len(args) > 2 else kwargs.get("context")
        unet = executor.class_obj
        if run.plan.shallow_steps == 0:  # interval 1, or no step in the start/end window: ComfyUI's forward as is
            run.full_calls += 1
            run.account(unet, x, context, shallow=False)
            return executor(*args, **kwargs)
        sigmas = transformer_options.get("sigmas")
        step = run.plan.step_of(float(sigmas.reshape(-1)[0]), run.step) if sigmas is not None else None
        run.step = step
        keys = chunk_keys(transformer_options, x.shape[0])
        signature = (x.shape[0] // len(keys) if keys else 0, tuple(x.shape[1:]), x.dtype, x.device)
        capture = unet_paths.DeepFeatureCapture(len(unet.output_blocks) - 1 - self.depth)

        if keys and run.plan.is_shallow(step):
            cached = run.lookup(keys, step, signature)
            if cached is not None:
                capture.armed = False  # installed only so blocks see the same patch structure as on full steps
                deep_h = cached[0] if len(cached) == 1 else torch.cat(cached)
                with unet_paths.capture_installed(transformer_options, capture):
                    out = unet_paths.shallow_forward(unet, self.depth, deep_h, *args, **kwargs)
                run.shallow_calls += 1
                run.reused_steps.add(step)
                run.account(unet, x, context, shallow=True)
                return out
            run.fallback_calls += 1

        capture.armed = bool(keys) and step is not None and run.plan.cache_needed_after(step)
        with unet_paths.capture_installed(transformer_options, capture):
            out = executor(*args, **kwargs)
        if capture.armed and capture.h is not None:
            run.store(keys, step, signature, capture.h)
        elif keys:  # no later step reads these chunks' features: free them now rather than at the end of the run
            for key in keys:
                run.features.pop(key, None)
        run.full_calls += 1
        run.account(unet, x, context, shallow=False)
        return out


def apply(model_patcher, config: DeepCacheConfig):
    """Returns (clone of `model_patcher` with DeepCache, branch depth used, message), or (None, None, reason)
    when its diffusion model is not a UNetModel. The input patcher is never modified."""
    import comfy.patcher_extension as pe

    diffusion_model = model_patcher.get_model_object("diffusion_model")
    if not unet_paths.is_unet(diffusion_model):
        return None, None, (f"{type(diffusion_model).__name__} is not a ComfyUI UNetModel (DeepCache needs the "
                            "UNet's skip connections; DiT models such as Flux, SD3 or Wan have none)")
    branches = unet_paths.branch_count(diffusion_model)
    depth = min(config.depth, branches - 1)
    message = f"interval {config.interval}, branch {depth} of 0..{branches - 1}, {config.schedule} schedule"
    if depth != config.depth:
        message += f" (cache depth {config.depth} is beyond this UNet's deepest branch {branches - 1})"
    if config.start_percent >= config.end_percent and config.interval > 1:
        message += " (start_percent >= end_percent: no step may reuse features, every step runs in full)"
    clone = model_patcher.clone()
    # Applying DeepCache twice replaces the first one rather than nesting two caches.
    for wrapper_type in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.DIFFUSION_MODEL):
        clone.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
    clone.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, OuterSampleWrapper(config, depth))
    clone.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, DiffusionModelWrapper(depth))
    return clone, depth, message
