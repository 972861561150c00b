"""DeepCache on a ComfyUI ModelPatcher: two wrappers and the per-run state they share. UNet models (unet_paths.py)
reuse the deep feature of a skip branch; transformer models (dit_paths.py) reuse the residual of their middle blocks.

- The OUTER_SAMPLE wrapper runs once per sampling run (each `CFGGuider.sample`: every KSampler, every pass
  of a hires fix or refiner). It plans the run from the run's own sigma schedule, puts a fresh `RunState`
  into the run's copy of the transformer options, and drops it in `finally` (success, error, interrupt).
  This is the pattern of ComfyUI's own EasyCache node.
- On a transformer, an APPLY_MODEL wrapper decides per model call whether the span patches of dit_paths.py
  capture their residuals, reuse them or let the blocks run; the rest below is the UNet's.
- The DIFFUSION_MODEL wrapper runs per UNet call. It finds the step from the call's sigma, and runs either
  ComfyUI's own forward (full step, capturing the deep feature) or the shallow path on the cached feature.
  DIFFUSION_MODEL is inside APPLY_MODEL, so blocks compiled by Compile Model from an APPLY_MODEL wrapper
  are in place on both paths, whatever the node order.

In adaptive mode (adaptive.py) the plan leaves most steps open and each call decides in plain Python: a UNet call
before it runs, from its input latent; a transformer call in its block loop, from the first skipped span's input.

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
from . import dit_paths, unet_paths
from .adaptive import DEFAULT_THRESHOLD, AdaptiveCall, AdaptivePolicy
from .schedule import ADAPTIVE, ADAPTIVE_MIN_STEPS, SCHEDULES, StepPlan, make_plan

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


@dataclass
class _Entry:
    step: int
    signature: tuple
    h: object  # the deep feature of one cond chunk
    reference: object = None  # adaptive: the signal of this chunk at `step` (adaptive.py)
    reused: set = field(default_factory=set)  # adaptive: the steps that reused this entry


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
    partial_calls: int = 0  # adaptive, transformer: calls in which some cond chunks reused and others ran
    reused_steps: set = field(default_factory=set)
    flops: float = 0.0  # estimated FLOPs of all UNet calls of the run, had they all been full
    skipped_flops: float = 0.0  # the part of it that shallow calls skipped
    estimates: dict = field(default_factory=dict)  # (H, W, context tokens) -> (full, shallow) FLOPs per sample
    dit_skipped_share: float | None = None  # a DiT's: the share of a full call that its spans hold (fixed)

    def entries(self, keys, step: int, signature: tuple) -> list[_Entry] | None:
        """The cached entry of every chunk of this call, or None. An entry is valid if it was computed at this
        step's source full step or later (a fallback full step refreshes it), and for the same shape; in adaptive
        mode, at any earlier full step of this run (the signal decides whether it is still close enough)."""
        source = 0 if self.plan.adaptive else self.plan.source(step)
        found = []
        for key in keys:
            entry = self.features.get(key)
            if entry is None or source is None or not source <= entry.step <= step or entry.signature != signature:
                return None
            found.append(entry)
        return found

    def adaptive_call(self, entries: list[_Entry], step: int) -> AdaptiveCall:
        """Adaptive mode's decision for a call whose chunks all have entries (made later, from the signal)."""
        return AdaptiveCall(policy=self.config.policy(), references=[e.reference for e in entries],
                            reused_in_row=[len(e.reused - {step}) for e in entries])

    def mark_reused(self, keys, step: int, which=None) -> None:
        for i, key in enumerate(keys):
            if which is None or which[i]:
                self.features[key].reused.add(step)

    def locate(self, transformer_options: dict, x: torch.Tensor) -> tuple:
        """This model call's step (from its sigma, in the run's plan), its cond-chunk keys (chunk_keys) and the
        signature its cached features must match (per-chunk batch, shape, dtype, device)."""
        sigmas = transformer_options.get("sigmas")
        self.step = self.plan.step_of(float(sigmas.reshape(-1)[0]), self.step) if sigmas is not None else None
        keys = chunk_keys(transformer_options, x.shape[0])
        signature = (x.shape[0] // len(keys) if keys else 0, tuple(x.shape[1:]), x.dtype, x.device)
        return self.step, keys, signature

    def forget(self, keys) -> None:
        for key in keys or ():
            self.features.pop(key, None)

    def store(self, keys, step: int, signature: tuple, h, signal=None) -> None:
        references = signal.chunk(len(keys)) if signal is not None else [None] * len(keys)
        for i, chunk in enumerate(h.chunk(len(keys))):
            self.features[keys[i]] = _Entry(step, signature, chunk, references[i])

    def store_parts(self, keys, step: int, signature: tuple, parts: list, signal=None, skip=None) -> None:
        """One entry per chunk from a call's parts; `skip` flags chunks that keep their entry (they reused)."""
        references = signal.chunk(len(keys)) if signal is not None else [None] * len(keys)
        for i, (key, part) in enumerate(zip(keys, parts)):
            if not (skip and skip[i]):
                self.features[key] = _Entry(step, signature, part, references[i])

    def account_dit(self, batch: int, shallow: bool) -> None:
        """A DiT call's compute, in units of one sample's full call (the spans' share is fixed by the model)."""
        self.flops += batch
        if shallow and self.dit_skipped_share is not None:
            self.skipped_flops += batch * self.dit_skipped_share

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
        shallow_share = round(known[0][1] / known[0][0], 4) if known else None
        estimate = "FLOPs of convolutions, linear layers and attention matmuls"
        if self.dit_skipped_share is not None:
            shallow_share = round(1 - self.dit_skipped_share, 4)
            estimate = "parameters used per token (linear layers; attention's own matmuls left out)"
        return {
            "status": status, "steps": self.plan.steps, "planned_shallow_steps": self.plan.shallow_steps,
            "reused_steps": len(self.reused_steps), "full_calls": self.full_calls,
            "shallow_calls": self.shallow_calls, "fallback_calls": self.fallback_calls,
            "partial_calls": self.partial_calls,
            "shallow_share": shallow_share,
            "compute_skipped": round(self.skipped_flops / self.flops, 4) if self.flops else None,
            "estimate": estimate,
            "interval": self.config.interval, "depth": self.depth, "schedule": self.config.schedule,
            "threshold": self.config.threshold if self.plan.adaptive else None,
            "node": self.config.owner,
        }


def chunk_keys(transformer_options: dict, batch: int):
    """One key per cond chunk of this call: ComfyUI's per-cond `uuids` (new for every run), or failing that
    the cond/uncond index. None when the call cannot be split into chunks (then it is never served from cache)."""
    for name in ("uuids", "cond_or_uncond"):
        keys = transformer_options.get(name)
        if keys and batch % len(keys) == 0 and len(set(keys)) == len(keys):
            return [(name, k) for k in keys]
    return None


def start_run(config: DeepCacheConfig, depth: int, sigmas, model_sampling, dit_share=None) -> RunState:
    """A fresh RunState for a run over `sigmas` (the run's schedule, as ComfyUI passes it to OUTER_SAMPLE and
    puts into transformer_options["sample_sigmas"]). Percents become sigmas through the model's own sampling."""
    start = model_sampling.percent_to_sigma(config.start_percent)
    end = model_sampling.percent_to_sigma(config.end_percent)
    plan = make_plan(sigmas.tolist() if hasattr(sigmas, "tolist") else sigmas, config.interval, config.schedule,
                     start, end)
    return RunState(config=config, depth=depth, plan=plan, dit_skipped_share=dit_share)


class OuterSampleWrapper:
    """OUTER_SAMPLE: one RunState per sampling run, dropped when the run ends however it ends."""

    def __init__(self, config: DeepCacheConfig, depth: int, dit_share: float | None = None):
        self.config, self.depth, self.dit_share = config, depth, dit_share

    def __call__(self, executor, *args, **kwargs):
        import comfy.model_patcher

        guider = executor.class_obj
        sigmas = args[3] if len(args) > 3 else kwargs["sigmas"]
        run = start_run(self.config, self.depth, sigmas, guider.model_patcher.get_model_object("model_sampling"),
                        self.dit_share)
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
    log.info("[Accel] DeepCache: deep features reused on %d of %d steps (%d shallow model calls, %d full%s); "
             "%s of the model's compute skipped (estimate; the shallow path is %s of a full call). Run %s.",
             report["reused_steps"], report["steps"], report["shallow_calls"], report["full_calls"],
             (f", {report['fallback_calls']} full for lack of a matching feature" if report["fallback_calls"] else "")
             + (f", {report['partial_calls']} with only some cond chunks reused" if report["partial_calls"] else ""),
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
        step, keys, signature = run.locate(transformer_options, x)
        capture = unet_paths.DeepFeatureCapture(len(unet.output_blocks) - 1 - self.depth)

        if keys and run.plan.is_shallow(step):
            entries = run.entries(keys, step, signature)
            decided_full = False
            if entries is not None and run.plan.adaptive:
                # The UNet's signal is its input latent, the same for every chunk of a step (adaptive.py).
                decided_full = not all(run.adaptive_call(entries, step).decide(x))
            if entries is not None and not decided_full:
                if run.plan.adaptive:
                    run.mark_reused(keys, step)
                capture.armed = False  # installed only so blocks see the same patch structure as on full steps
                deep_h = entries[0].h if len(entries) == 1 else torch.cat([entry.h for entry in entries])
                with unet_paths.capture_installed(transformer_options, capture):
                    out = unet_paths.shallow_forward(unet, self.depth, deep_h, *args, **kwargs)
                run.shallow_calls += 1
                run.reused_steps.add(step)
                run.account(unet, x, context, shallow=True)
                return out
            if not decided_full:
                run.fallback_calls += 1

        capture.armed = bool(keys) and step is not None and run.plan.cache_needed_after(step)
        with unet_paths.capture_installed(transformer_options, capture):
            out = executor(*args, **kwargs)
        if capture.armed and capture.h is not None:
            run.store(keys, step, signature, capture.h, x.clone() if run.plan.adaptive else None)
        else:  # no later step reads these chunks' features: free them now rather than at the end of the run
            run.forget(keys)
        run.full_calls += 1
        run.account(unet, x, context, shallow=False)
        return out


def transformer_options_of(args: tuple, kwargs: dict) -> dict | None:
    """The call's transformer_options among a DiT forward's arguments (each family passes them at another
    position; the run's own copy carries RUN_KEY)."""
    found = kwargs.get("transformer_options")
    if isinstance(found, dict):
        return found
    return next((a for a in args if isinstance(a, dict) and RUN_KEY in a), None)


class DiTApplyModelWrapper:
    """APPLY_MODEL on a transformer: decides, in plain Python before the call, whether the span patches
    (dit_paths.py) capture residuals, reuse them, or stay out of the way, and keeps what a full call captured.
    The patches read the decision from the call's own transformer_options (dit_paths.CALL_KEY)."""

    def __call__(self, executor, *args, **kwargs):
        transformer_options = transformer_options_of(args, kwargs)
        run = transformer_options.get(RUN_KEY) if transformer_options is not None else None
        x = args[0] if args else kwargs.get("x")
        if run is None or not isinstance(x, torch.Tensor) or run.plan.shallow_steps == 0:
            if run is not None:
                run.full_calls += 1
                run.account_dit(x.shape[0] if isinstance(x, torch.Tensor) else 1, shallow=False)
            return executor(*args, **kwargs)
        step, keys, signature = run.locate(transformer_options, x)
        call = dit_paths.SpanCall()
        # A ControlNet adds its residuals after each block, inside the span too: a reused span would add them on
        # top of a residual that holds them already, so such calls run in full (APPLY_MODEL's 5th argument).
        control = args[4] if len(args) > 4 else kwargs.get("control")
        planned_shallow = bool(keys) and run.plan.is_shallow(step) and control is None
        if planned_shallow:
            entries = run.entries(keys, step, signature)
            if entries is not None:
                call.residuals = dit_paths.join_residuals([e.h for e in entries])
                if run.plan.adaptive:  # decided in the block loop, from the first span's input
                    call.adaptive = run.adaptive_call(entries, step)
        if not call.residuals or call.adaptive is not None:
            call.capture = bool(keys) and step is not None and (run.plan.cache_needed_after(step)
                                                                 or call.adaptive is not None)
        transformer_options[dit_paths.CALL_KEY] = call  # this call's own options (a copy per model call)
        try:
            out = executor(*args, **kwargs)
        finally:
            transformer_options.pop(dit_paths.CALL_KEY, None)
        if call.reusing and not call.ran_spans:  # every span served from its residual
            if call.adaptive is not None:
                run.mark_reused(keys, step)
            run.shallow_calls += 1
            run.reused_steps.add(step)
            run.account_dit(x.shape[0], shallow=True)
            return out
        reused = call.adaptive.reuse if call.adaptive is not None and call.adaptive.mixed else None
        if planned_shallow and (call.adaptive is None or call.reusing or call.adaptive.reuse is None):
            run.fallback_calls += 1  # no matching residuals, or a span ran after all
        run.full_calls += 1
        run.account_dit(x.shape[0], shallow=False)
        if call.capture and call.captured:
            # Chunks that reused in a call where others did not keep their entry, as they would alone.
            run.store_parts(keys, step, signature, dit_paths.split_residuals(call.captured, len(keys)),
                            call.signal if run.plan.adaptive else None, skip=reused)
            if reused:
                run.mark_reused(keys, step, reused)
                run.partial_calls += 1
        else:  # no later step reads these chunks' residuals: free them now
            run.forget(keys)
        return out


def apply(model_patcher, config: DeepCacheConfig):
    """Returns (clone of `model_patcher` with DeepCache, depth used, message), or (None, None, reason) when its
    diffusion model is neither a ComfyUI UNetModel nor a transformer whose block loop takes ComfyUI's per-block
    replace patches. The input patcher is never modified."""
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    if dit_paths.is_dit(diffusion_model):
        return _apply_dit(model_patcher, diffusion_model, config)
    if not unet_paths.is_unet(diffusion_model):
        return None, None, (f"{type(diffusion_model).__name__} is neither a ComfyUI UNetModel nor a transformer "
                            "DeepCache knows (" + ", ".join(dit_paths.BLOCK_LISTS) + ")")
    return _apply_unet(model_patcher, diffusion_model, config)


def schedule_text(config: DeepCacheConfig) -> str:
    if config.schedule == ADAPTIVE:
        return (f"adaptive schedule (threshold {config.threshold:g}, at most {config.interval - 1} reused steps in "
                f"a row, runs under {ADAPTIVE_MIN_STEPS} steps left alone)")
    return f"{config.schedule} schedule"


def _with_wrappers(model_patcher, outer, inner, inner_type: str):
    import comfy.patcher_extension as pe

    clone = model_patcher.clone()
    # Applying DeepCache twice replaces the first one rather than nesting two caches.
    for wrapper_type in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.DIFFUSION_MODEL, pe.WrappersMP.APPLY_MODEL):
        clone.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
    clone.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer)
    clone.add_wrapper_with_key(inner_type, WRAPPER_KEY, inner)
    return clone


def _apply_dit(model_patcher, diffusion_model, config: DeepCacheConfig):
    """On a transformer, `depth` is how many blocks stay live at each end beyond the first and last one."""
    live = config.depth + 1
    spans = dit_paths.plan_spans(diffusion_model, live)
    name = type(diffusion_model).__name__
    if not spans:
        return None, None, (f"{name} has too few blocks to keep {live} live at each end (cache depth "
                            f"{config.depth}): nothing would be reused")
    import comfy.patcher_extension as pe

    share = dit_paths.skipped_share(diffusion_model, spans)
    inner = DiTApplyModelWrapper()
    # APPLY_MODEL, not DIFFUSION_MODEL: every family's model call goes through it (SD3's MMDiT has no
    # DIFFUSION_MODEL wrapper in ComfyUI 0.3.75), and its arguments carry the call's transformer_options.
    clone = _with_wrappers(model_patcher, OuterSampleWrapper(config, config.depth, share), inner,
                           pe.WrappersMP.APPLY_MODEL)
    existing = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for span in spans:
        for block in span.blocks():
            other = existing.get((span.patch_name, block))  # another node's patch of this block keeps working
            other = None if isinstance(other, dit_paths.SpanBlockPatch) else other
            clone.set_model_patch_replace(dit_paths.SpanBlockPatch(span, block, other), "dit",
                                          span.patch_name, block)
    skipped = ", ".join(f"{s.patch_name}s {s.first}-{s.last}" for s in spans)
    message = (f"{name}: interval {config.interval}, reused steps skip {skipped} (about "
               f"{100 * (share or 0):.0f}% of a call), {schedule_text(config)}")
    if config.start_percent >= config.end_percent and config.interval > 1:
        message += " (start_percent >= end_percent: no step may reuse features, every step runs in full)"
    return clone, config.depth, message


def _apply_unet(model_patcher, diffusion_model, config: DeepCacheConfig):
    import comfy.patcher_extension as pe

    branches = unet_paths.branch_count(diffusion_model)
    depth = min(config.depth, branches - 1)
    message = f"interval {config.interval}, branch {depth} of 0..{branches - 1}, {schedule_text(config)}"
    if depth != config.depth:
        message += f" (cache depth {config.depth} is beyond this UNet's deepest branch {branches - 1})"
    if config.start_percent >= config.end_percent and config.interval > 1:
        message += " (start_percent >= end_percent: no step may reuse features, every step runs in full)"
    clone = _with_wrappers(model_patcher, OuterSampleWrapper(config, depth), DiffusionModelWrapper(depth),
                           pe.WrappersMP.DIFFUSION_MODEL)
    return clone, depth, message
