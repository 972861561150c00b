"""Everything DeepCache knows during one sampling run (`RunState`): the run's plan, the cached features of its cond
chunks, what each model call decided (`ModelCall`, once per call, used by both model paths) and the compute it
skipped. Created by the OUTER_SAMPLE wrapper (runtime.py) for each run, dropped when the run ends.

Cached features are keyed per cond chunk (`uuids`, one per cond/uncond entry, new for every run; with ComfyUI's
context windows, per window too), per full step, and by shape, dtype and device; a call that finds no matching
feature does a full step. So cond and uncond, batched or split, a changed batch size or resolution, another
sampler, another context window, or a model unloaded between runs cannot read another call's features; a guidance
node's own call for a cond (locate) neither reads nor writes them.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from .. import telemetry
from . import unet_paths
from .adaptive import AdaptiveCall, progress_along
from .config import DeepCacheConfig
from .schedule import ADAPTIVE_MIN_STEPS, StepPlan, make_plan

log = logging.getLogger("comfyui_accel")

FEATURE = "deepcache"
RUN_KEY = "accel_deepcache_run"  # the run's RunState, in the run's own copy of transformer_options


@dataclass
class _Entry:
    step: int
    signature: tuple
    h: object  # the deep feature of one cond chunk
    reference: object = None  # adaptive: the signal of this chunk at `step` (adaptive.py)
    reused: set = field(default_factory=set)  # adaptive: the steps that reused this entry
    previous: "_Entry | None" = None  # forecast: the entry of the full step before, same signature


def extrapolate(h, previous, factor: float):
    """h + (h - previous) * factor, over a feature (a UNet's tensor) or a residual dict ({span: {stream: tensor}})."""
    if isinstance(h, dict):
        return {k: extrapolate(v, previous[k], factor) for k, v in h.items()}
    if h is None:  # a stream that ends inside the span (dit_paths.py)
        return None
    return (h - previous).mul_(factor).add_(h)  # one new tensor a call, not three (the same values)


def extrapolate2(h, previous, before, a: float, b: float):
    """h + a (h - previous) - b (previous - before): the parabola through three features (quadratic_factors)."""
    if isinstance(h, dict):
        return {k: extrapolate2(v, previous[k], before[k], a, b) for k, v in h.items()}
    if h is None:
        return None
    return (h - previous).mul_(a).add_(h).sub_((previous - before).mul_(b))


def quadratic_factors(s: float, s2: float, s1: float, s0: float) -> tuple[float, float] | None:
    """(a, b) such that h2 + a (h2 - h1) - b (h1 - h0) is the parabola through (s0, h0), (s1, h1), (s2, h2) taken
    at s: Newton's form h2 + (s - s2) f[s2, s1] + (s - s2)(s - s1) f[s2, s1, s0], in sigma. None where two of the
    three sigmas are equal (no parabola)."""
    if s2 == s1 or s1 == s0 or s2 == s0:
        return None
    curve = (s - s2) * (s - s1) / (s2 - s0)
    return (s - s2) / (s2 - s1) + curve / (s2 - s1), curve / (s1 - s0)


def forecast_quadratic(entry: _Entry, sigmas, step: int):
    """Forecast "quadratic": the parabola in sigma through `entry`'s feature and its two previous ones, taken at
    `step`'s sigma; None where two of their sigmas are equal."""
    previous, before = entry.previous, entry.previous.previous
    factors = quadratic_factors(sigmas[step], sigmas[entry.step], sigmas[previous.step], sigmas[before.step])
    return None if factors is None else extrapolate2(entry.h, previous.h, before.h, *factors)


def free_before_kept(entry: _Entry, forecast: str) -> None:
    """What a full call's new entry will not keep of `entry`'s: the entries before its previous one, or before
    the one before that with "quadratic"."""
    if forecast == "quadratic" and entry.previous is not None:
        entry.previous.previous = None
    else:
        entry.previous = None


@dataclass
class ModelCall:
    """One model call's place in the run and what it may reuse, decided once before the call runs (by
    `RunState.call`); both model paths (runtime.py: the UNet's and the transformer's) only act on it."""
    step: int | None
    keys: list | None  # one per cond chunk (chunk_keys); None: the call cannot be split, never served from cache
    signature: tuple  # what a cached feature must match: per-chunk batch, shape, dtype, device
    planned_shallow: bool  # the plan lets this step reuse, and the call may
    entries: list | None = None  # planned shallow and every chunk has a valid entry: what it may reuse
    adaptive: AdaptiveCall | None = None  # adaptive mode with entries: reuse decided later from the signal
    keeps_features: bool = False  # a later step of the plan reads what this call computes in full


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
    ran_full: dict = field(default_factory=dict)  # why planned reuses ran in full instead -> calls (`call`)
    reused_steps: set = field(default_factory=set)
    flops: float = 0.0  # estimated FLOPs of all UNet calls of the run, had they all been full
    skipped_flops: float = 0.0  # the part of it that shallow calls skipped
    estimates: dict = field(default_factory=dict)  # (H, W, context tokens) -> (full, shallow) FLOPs per sample
    dit_skipped_share: float | None = None  # a DiT's: the share of a full call that its spans hold (fixed)
    evaluations: int = 0  # the sampler's evaluations of the model so far (new_evaluation)
    called_keys: set = field(default_factory=set)  # the chunk keys called in the current evaluation (locate)

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

    def reused_feature(self, entry: _Entry, step: int, signal=None):
        """What a reused `step` adds for `entry`'s chunk: its feature as it is; with forecast "linear" the line
        through the last two full steps' features, in sigma, taken at this step's sigma; with "fitted" the same
        line taken as far as `signal` (this chunk's adaptive signal at this step) moved along its own last change
        (adaptive.progress_along; no signal: the feature as it is)."""
        previous = entry.previous
        if previous is None:
            return entry.h
        sigmas = self.plan.sigmas
        if self.config.forecast == "quadratic" and previous.previous is not None:
            parabola = forecast_quadratic(entry, sigmas, step)
            if parabola is not None:
                return parabola
        span = sigmas[entry.step] - sigmas[previous.step]
        if span == 0:
            return entry.h
        factor = (sigmas[step] - sigmas[entry.step]) / span
        if self.config.forecast == "fitted":
            factor = progress_along(signal, entry.reference, previous.reference, limit=factor)
            if factor == 0:
                return entry.h
        return extrapolate(entry.h, previous.h, factor)

    def _entry(self, key, step: int, signature: tuple, h, reference) -> _Entry:
        """A chunk's new entry; with a forecast it keeps the one it replaces (without that one's own previous),
        or, replacing one of the same step (a sampler's second call in a step: heun, dpm_2, the SDE samplers),
        that one's previous: the line's other end stays the last full step before this one. With "quadratic" the
        one it replaces keeps its own previous too (without that one's): the last three full steps."""
        old = self.features.get(key)
        previous = None
        if self.config.forecast != "off" and old is not None and old.signature == signature:
            if old.step < step:
                before = old.previous if self.config.forecast == "quadratic" else None
                previous = dataclasses.replace(
                    old, previous=None if before is None else dataclasses.replace(before, previous=None))
            elif old.step == step:
                previous = old.previous
        return _Entry(step, signature, h, reference, previous=previous)

    def mark_reused(self, keys, step: int, which=None) -> None:
        for i, key in enumerate(keys):
            if which is None or which[i]:
                self.features[key].reused.add(step)

    def call(self, transformer_options: dict, x: torch.Tensor, refused: str | None = None) -> ModelCall:
        """The decision for this model call. `refused`: why this call may not reuse whatever the plan (a
        ControlNet's residuals on a transformer, another node's block patch); a call the plan would have let
        reuse is then counted under that reason, which the run's report names."""
        step, keys, signature = self.locate(transformer_options, x)
        planned = bool(keys) and self.plan.is_shallow(step)
        if planned and refused is not None:
            self.ran_full[refused] = self.ran_full.get(refused, 0) + 1
        call = ModelCall(step, keys, signature, planned and refused is None)
        if call.planned_shallow:
            call.entries = self.entries(keys, step, signature)
            if call.entries is not None and self.plan.adaptive:
                call.adaptive = self.adaptive_call(call.entries, step)
        call.keeps_features = bool(keys) and step is not None and self.plan.cache_needed_after(step)
        return call

    def note_reused(self, call: ModelCall) -> None:
        """A call that reused every chunk's feature: a shallow call of a reused step."""
        if call.adaptive is not None:
            self.mark_reused(call.keys, call.step)
        self.shallow_calls += 1
        self.reused_steps.add(call.step)

    def new_evaluation(self) -> None:
        """The sampler evaluates the model anew (runtime.PredictNoiseWrapper: each CFGGuider.predict_noise)."""
        self.evaluations += 1
        self.called_keys.clear()

    def locate(self, transformer_options: dict, x: torch.Tensor) -> tuple:
        """This model call's step (from its sigma, in the run's plan), its cond-chunk keys (chunk_keys) and the
        signature its cached features must match (per-chunk batch, shape, dtype, device).

        A second call for a chunk within one evaluation of the sampler is not the sampler's call:
        PerturbedAttentionGuidance, SelfAttentionGuidance and SkipLayerGuidance run the cond again, with their own
        patches or input, after the sampler's call. Its features are not the cond's: it gets no keys, so it runs in
        full and neither reuses, stores nor frees the cond's entry. (A sampler's second evaluation in a step,
        heun's or dpm_2's, is an evaluation of its own and keeps its keys.)"""
        sigmas = transformer_options.get("sigmas")
        self.step = self.plan.step_of(float(sigmas.reshape(-1)[0]), self.step) if sigmas is not None else None
        keys = chunk_keys(transformer_options, x.shape[0])
        if keys and self.evaluations:  # evaluations counted (the PREDICT_NOISE wrapper ran)
            if self.called_keys.intersection(keys):
                keys = None
            else:
                self.called_keys.update(keys)
        signature = (x.shape[0] // len(keys) if keys else 0, tuple(x.shape[1:]), x.dtype, x.device)
        return self.step, keys, signature

    def drop_unread(self, keys) -> None:
        """Before the blocks of a call that reuses nothing (its outputs do not depend on this): free what only a
        reuse would read. Without a forecast, the chunks' entries (the call's capture replaces them, or else they
        are forgotten after it); with one, the entries before them (a new entry keeps only the one it replaces;
        with "quadratic", that one and the one before it)."""
        for key in keys or ():
            if self.config.forecast == "off":
                self.features.pop(key, None)
            elif key in self.features:
                free_before_kept(self.features[key], self.config.forecast)

    def forget(self, keys) -> None:
        for key in keys or ():
            self.features.pop(key, None)

    def store(self, keys, step: int, signature: tuple, h, signal=None) -> None:
        references = signal.chunk(len(keys)) if signal is not None else [None] * len(keys)
        for i, chunk in enumerate(h.chunk(len(keys))):
            self.features[keys[i]] = self._entry(keys[i], step, signature, chunk, references[i])

    def store_parts(self, keys, step: int, signature: tuple, parts: list, signal=None, skip=None) -> None:
        """One entry per chunk from a call's parts; `skip` flags chunks that keep their entry (they reused)."""
        references = signal.chunk(len(keys)) if signal is not None else [None] * len(keys)
        for i, (key, part) in enumerate(zip(keys, parts)):
            if not (skip and skip[i]):
                self.features[key] = self._entry(key, step, signature, part, references[i])

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
            "partial_calls": self.partial_calls, "ran_full": dict(self.ran_full), "shallow_share": shallow_share,
            "compute_skipped": round(self.skipped_flops / self.flops, 4) if self.flops else None,
            "estimate": estimate,
            "interval": self.config.interval, "depth": self.depth, "schedule": self.config.schedule,
            "threshold": self.config.threshold if self.plan.adaptive else None, "forecast": self.config.forecast,
            "live_blocks": None if self.dit_skipped_share is None else self.config.live_blocks,  # transformers only
            "signal": self.config.signal if self.plan.adaptive and self.dit_skipped_share is not None else None,
            "few_steps": self.plan.adaptive and self.plan.steps < ADAPTIVE_MIN_STEPS,  # left alone: all ran full
            "preset": self.config.preset, "node": self.config.owner,
        }


def chunk_keys(transformer_options: dict, batch: int):
    """One key per cond chunk of this call: ComfyUI's per-cond `uuids` (new for every run), with the cond/uncond
    index where a call holds one uuid twice (ComfyUI copies a positive area cond into the negative under its own
    uuid); without uuids (none in the call), the cond/uncond index. None when the call cannot be split into
    chunks (then it is never served from cache). The cond/uncond index alone never keys a call that has uuids:
    two area conds that take turns (ConditioningSetTimestepRange) each make calls of index [1, 0], and one read
    the other's features. Under ComfyUI's context windows each window calls the model with the same conds (uuids
    and all) on its own frames: the window's frame indices are part of the key, so each window reads its own."""
    window = getattr(transformer_options.get("context_window"), "index_list", None)
    window = tuple(window) if window is not None else None
    uuids, halves = transformer_options.get("uuids"), transformer_options.get("cond_or_uncond")
    if uuids:
        name, keys = "uuids", list(uuids)
        if len(set(keys)) != len(keys):
            keys = list(zip(uuids, halves)) if halves and len(halves) == len(uuids) else None
    else:
        name, keys = "cond_or_uncond", halves
    if keys and batch % len(keys) == 0 and len(set(keys)) == len(keys):
        return [(name, k) if window is None else (name, k, window) for k in keys]
    return None


def start_run(config: DeepCacheConfig, depth: int, sigmas, model_sampling, dit_share=None) -> RunState:
    """A fresh RunState for a run over `sigmas` (the run's schedule, as ComfyUI passes it to OUTER_SAMPLE and
    puts into transformer_options["sample_sigmas"]). Percents become sigmas through the model's own sampling."""
    start = model_sampling.percent_to_sigma(config.start_percent)
    end = model_sampling.percent_to_sigma(config.end_percent)
    plan = make_plan(sigmas.tolist() if hasattr(sigmas, "tolist") else sigmas, config.interval, config.schedule,
                     start, end)
    return RunState(config=config, depth=depth, plan=plan, dit_skipped_share=dit_share)


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
    if report["few_steps"]:
        log.info("[Accel] DeepCache: %s.", few_steps_text(report["steps"]))
    for reason, calls in report["ran_full"].items():  # a combination DeepCache passes through: said each run
        log.warning("[Accel] DeepCache%s: %d model call(s) it would have reused ran in full: %s.",
                    f" (node {report['node']})" if report["node"] else "", calls, reason)


def few_steps_text(steps: int) -> str:
    return (f"a run of {steps} steps, under {ADAPTIVE_MIN_STEPS}: the adaptive schedule reuses nothing on few-step "
            "(distilled) models, every step ran in full")
