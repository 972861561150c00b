"""DeepCache on a ComfyUI ModelPatcher: the wrappers that carry out, per model call, what the run's state decided.
UNet models (unet_paths.py) reuse the deep feature of a skip branch; transformer models (dit_paths.py) reuse the
residual of their middle blocks.

- The OUTER_SAMPLE wrapper runs once per sampling run (each `CFGGuider.sample`: every KSampler, every pass
  of a hires fix or refiner). It plans the run from the run's own sigma schedule, puts a fresh `RunState`
  (run_state.py) into the run's copy of the transformer options, and drops it in `finally` (success, error,
  interrupt). This is the pattern of ComfyUI's own EasyCache node.
- The PREDICT_NOISE wrapper marks each evaluation of the model by the sampler, so that a guidance node's second
  call for the same cond within it (PerturbedAttentionGuidance, SelfAttentionGuidance, SkipLayerGuidance) runs in
  full and leaves the cond's features alone (`RunState.locate`).
- Each model call asks the run once what it may reuse (`RunState.call`: its step, cond chunks and cached
  features) and then takes its model's path:
  - on a UNet, the DIFFUSION_MODEL wrapper runs either ComfyUI's own forward (full step, capturing the deep
    feature) or the shallow path on the cached feature. DIFFUSION_MODEL is inside APPLY_MODEL, so blocks compiled
    by Compile Model from an APPLY_MODEL wrapper are in place on both paths, whatever the node order;
  - on a transformer, an APPLY_MODEL wrapper tells the span patches of dit_paths.py whether they capture their
    residuals, reuse them or let the blocks run.

In adaptive mode (adaptive.py) the plan leaves most steps open and each call decides in plain Python: a UNet call
before it runs, from its input latent; a transformer call in its block loop, from the first skipped span's input.
"""
from __future__ import annotations

import functools

import torch

from .. import comfy_names, dynamic_vram
from ..families import DIT_BLOCK_LISTS
from . import dit_paths, presets, unet_paths
from .config import FIRST_BLOCK_RESIDUAL, DeepCacheConfig, schedule_text
from .run_state import FEATURE, RUN_KEY, ModelCall, RunState, report_run, start_run

WRAPPER_KEY = "accel_deepcache"

__all__ = ["FEATURE", "DeepCacheConfig", "apply"]


class OuterSampleWrapper:
    """OUTER_SAMPLE: one RunState per sampling run, dropped when the run ends however it ends."""

    def __init__(self, config: DeepCacheConfig, depth: int, dit_share: float | None = None):
        self.config, self.depth, self.dit_share = config, depth, dit_share

    def __call__(self, executor, *args, **kwargs):
        import comfy.model_patcher

        guider = executor.class_obj
        sigmas = args[3] if len(args) > 3 else kwargs["sigmas"]
        # What a newer ComfyUI may have renamed (comfy_names.NAMES): without it the run runs in full, unchanged.
        patcher = comfy_names.attr(guider, "model_patcher", "CFGGuider.model_patcher")
        original = comfy_names.attr(guider, "model_options", "CFGGuider.model_options")
        copy_options = comfy_names.attr(comfy.model_patcher, "create_model_options_clone",
                                        "comfy.model_patcher.create_model_options_clone")
        model_sampling = patcher.get_model_object("model_sampling") if patcher is not None else None
        if not callable(getattr(model_sampling, "percent_to_sigma", None)):
            if patcher is not None:
                comfy_names.warn_missing("model_sampling.percent_to_sigma", type(model_sampling).__name__)
            return executor(*args, **kwargs)
        if original is None or copy_options is None:
            return executor(*args, **kwargs)
        run = start_run(self.config, self.depth, sigmas, model_sampling, self.dit_share)
        # The run's own copy (as EasyCache does): the node's model_options, shared by every run, stay untouched.
        guider.model_options = copy_options(original)
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


class PredictNoiseWrapper:
    """PREDICT_NOISE: tells the run that the sampler evaluates the model anew, so that a second model call for the
    same cond within one evaluation (a guidance node's extra call) is told apart from the sampler's own
    (RunState.locate)."""

    def __call__(self, executor, *args, **kwargs):
        run = executor.class_obj.model_options.get("transformer_options", {}).get(RUN_KEY)
        if run is not None:
            run.new_evaluation()
        return executor(*args, **kwargs)


class DiffusionModelWrapper:
    """DIFFUSION_MODEL: full or shallow UNet call, as the run decided for it."""

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
        call = run.call(transformer_options, x)
        capture = unet_paths.DeepFeatureCapture(len(unet.output_blocks) - 1 - self.depth)

        if call.planned_shallow:
            # The UNet's signal is its input latent, the same for every chunk of a step (adaptive.py).
            decided_full = call.adaptive is not None and not all(call.adaptive.decide(x))
            if call.entries is not None and not decided_full:
                capture.armed = False  # installed only so blocks see the same patch structure as on full steps
                signals = x.chunk(len(call.entries))  # forecast "fitted" follows each chunk's signal
                features = [run.reused_feature(e, call.step, signal) for e, signal in zip(call.entries, signals)]
                deep_h = features[0] if len(features) == 1 else torch.cat(features)
                with unet_paths.capture_installed(transformer_options, capture):
                    out = unet_paths.shallow_forward(unet, self.depth, deep_h, *args, **kwargs)
                run.note_reused(call)
                run.account(unet, x, context, shallow=True)
                return out
            if not decided_full:
                run.fallback_calls += 1

        capture.armed = call.keeps_features
        with unet_paths.capture_installed(transformer_options, capture):
            out = executor(*args, **kwargs)
        if capture.armed and capture.h is not None:
            run.store(call.keys, call.step, call.signature, capture.h, x.clone() if run.plan.adaptive else None)
        else:  # no later step reads these chunks' features: free them now rather than at the end of the run
            run.forget(call.keys)
        run.full_calls += 1
        run.account(unet, x, context, shallow=False)
        return out


def origin_of(patch) -> str:
    """Where another node's patch comes from, as its module and name tell (a function's, or its class's)."""
    if patch is None:
        return "the patch was removed"
    named = patch if hasattr(patch, "__qualname__") else type(patch)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def transformer_options_of(args: tuple, kwargs: dict) -> dict | None:
    """The call's transformer_options among a DiT forward's arguments (each family passes them at another
    position; the run's own copy carries RUN_KEY)."""
    found = kwargs.get("transformer_options")
    if isinstance(found, dict):
        return found
    return next((a for a in args if isinstance(a, dict) and RUN_KEY in a), None)


class DiTApplyModelWrapper:
    """APPLY_MODEL on a transformer: tells the span patches (dit_paths.py), before the call, whether they capture
    residuals, reuse them, or stay out of the way, as the run decided, and keeps what a full call captured. The
    patches read it from the call's own transformer_options (dit_paths.CALL_KEY)."""

    def __init__(self, span_blocks: frozenset = frozenset(), head: tuple | None = None):
        self.span_blocks = span_blocks  # the ("double_block" | "single_block", i) keys of the spans' patches
        self.span_order = tuple(sorted(span_blocks, key=str))  # refusal's walk, sorted once: it runs every call
        self.head = head  # signal "first block residual": the first block's key, where its HeadBlockPatch is

    def refusal(self, args: tuple, kwargs: dict, transformer_options: dict) -> str | None:
        """Why this call may not reuse a span's residual, whatever the plan (it then runs in full and the run's
        report says why), or None."""
        # A ControlNet adds its residuals after each block, inside the span too: a reused span would add them on
        # top of a residual that holds them already (APPLY_MODEL's 5th argument).
        if (args[4] if len(args) > 4 else kwargs.get("control")) is not None:
            return "a ControlNet adds its residuals between the blocks DeepCache would skip"
        # A patch ComfyUI's block loops run after every block ("double_block": Qwen-Image's DiffSynth ControlNet;
        # Wan's loop runs them too in newer ComfyUI) would run on a residual that holds its work already.
        if (transformer_options.get("patches") or {}).get("double_block"):
            return "a patch that runs after every block (another node's double_block patch) is on the model"
        # A node applied after DeepCache that replaced a span block's patch with its own (PuLID-style nodes): on a
        # reused call that block would run on top of the residual. (One applied before keeps working: the span's
        # patch wraps it.)
        dit = (transformer_options.get("patches_replace") or {}).get("dit") or {}
        for key in self.span_order:
            patch = dit.get(key)
            if not isinstance(patch, dit_paths.SpanBlockPatch):
                return (f"another node replaced the patch of {key[0]} {key[1]}, which DeepCache would skip, "
                        f"after DeepCache was applied ({origin_of(patch)})")
        if self.head is not None and not isinstance(dit.get(self.head), dit_paths.HeadBlockPatch):
            # the signal "first block residual" needs the first block's input, which its patch keeps
            return (f"another node replaced the patch of {self.head[0]} {self.head[1]}, where DeepCache measures "
                    f"the first block's residual, after DeepCache was applied ({origin_of(dit.get(self.head))})")
        return None

    def __call__(self, executor, *args, **kwargs):
        transformer_options = transformer_options_of(args, kwargs)
        run = transformer_options.get(RUN_KEY) if transformer_options is not None else None
        x = args[0] if args else kwargs.get("x")
        if run is None or not isinstance(x, torch.Tensor) or run.plan.shallow_steps == 0:
            if run is not None:
                run.full_calls += 1
                run.account_dit(x.shape[0] if isinstance(x, torch.Tensor) else 1, shallow=False)
            return executor(*args, **kwargs)
        decided = run.call(transformer_options, x, refused=self.refusal(args, kwargs, transformer_options))
        call = dit_paths.SpanCall()
        if decided.entries is not None:
            call.adaptive = decided.adaptive  # adaptive: decided in the block loop, from the first span's input
            if call.adaptive is None:
                call.residuals = reused_residuals(run, decided)
            else:  # made once the signal is measured, and only if a chunk reuses (forecast "fitted" reads it)
                call.residuals = dict.fromkeys(decided.entries[0].h)  # the spans served, until then
                call.pending = functools.partial(reused_residuals, run, decided)
        if not call.residuals or call.adaptive is not None:
            call.capture = decided.keeps_features or (call.adaptive is not None and bool(decided.keys)
                                                      and decided.step is not None)
        # signal "first block residual": a call that decides from it, or keeps it as the next steps' reference
        call.wants_head = self.head is not None and (call.adaptive is not None or (call.capture and run.plan.adaptive))
        # What only a reuse reads is freed before the blocks of a call that reuses nothing, so the old features
        # do not add to the blocks' peak memory (at video sizes a feature is hundreds of MB on the GPU).
        if decided.entries is None:
            run.drop_unread(decided.keys)
        elif call.adaptive is not None:
            call.on_all_run = functools.partial(drop_unread_of_call, run, decided)
        transformer_options[dit_paths.CALL_KEY] = call  # this call's own options (a copy per model call)
        try:
            out = executor(*args, **kwargs)
        finally:
            transformer_options.pop(dit_paths.CALL_KEY, None)
        if call.reusing and not call.ran_spans:  # every span served from its residual
            run.note_reused(decided)
            run.account_dit(x.shape[0], shallow=True)
            return out
        reused = call.adaptive.reuse if call.adaptive is not None and call.adaptive.mixed else None
        if decided.planned_shallow and (call.adaptive is None or call.reusing or call.adaptive.reuse is None):
            run.fallback_calls += 1  # no matching residuals, or a span ran after all
        run.full_calls += 1
        run.account_dit(x.shape[0], shallow=False)
        if call.capture and call.captured:
            # Chunks that reused in a call where others did not keep their entry, as they would alone.
            run.store_parts(decided.keys, decided.step, decided.signature,
                            dit_paths.split_residuals(call.captured, len(decided.keys)),
                            call.signal if run.plan.adaptive else None, skip=reused)
            if reused:
                run.mark_reused(decided.keys, decided.step, reused)
                run.partial_calls += 1
        else:  # no later step reads these chunks' residuals: free them now
            run.forget(decided.keys)
        return out


def drop_unread_of_call(run: RunState, decided: ModelCall) -> None:
    """An adaptive call in which no chunk reuses: the run's drop_unread, and the call's own hold on the entries
    and the references it decided from."""
    run.drop_unread(decided.keys)
    if run.config.forecast == "off":
        decided.entries = None
        decided.adaptive.references = [None] * len(decided.adaptive.references)


def reused_residuals(run: RunState, decided: ModelCall, signal: torch.Tensor | None = None) -> dict:
    """A reused call's residuals, every chunk's joined: each chunk's feature as the run's forecast makes it, from
    the chunk's part of the adaptive `signal` where it has one."""
    signals = signal.chunk(len(decided.entries)) if signal is not None else [None] * len(decided.entries)
    return dit_paths.join_residuals([run.reused_feature(e, decided.step, s) for e, s in zip(decided.entries, signals)])


def apply(model_patcher, config: DeepCacheConfig):
    """Returns (clone of `model_patcher` with DeepCache, depth used, message), or (None, None, reason) when its
    diffusion model is neither a ComfyUI UNetModel nor a transformer whose block loop takes ComfyUI's per-block
    replace patches. The input patcher is never modified."""
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    renamed = _missing_names(model_patcher)
    if renamed:
        return None, None, renamed
    transformer = dit_paths.is_dit(diffusion_model)
    config = presets.resolve(config, presets.model_kind(diffusion_model, transformer))
    if transformer:
        clone, depth, message = _apply_dit(model_patcher, diffusion_model, config)
    elif not unet_paths.is_unet(diffusion_model):
        renamed = dit_paths.missing_lists(diffusion_model)
        return None, None, renamed or (f"{type(diffusion_model).__name__} is neither a ComfyUI UNetModel nor a "
                                       "transformer DeepCache knows (" + ", ".join(DIT_BLOCK_LISTS) + ")")
    else:
        renamed = unet_paths.missing_names(diffusion_model)
        if renamed:
            return None, None, renamed
        clone, depth, message = _apply_unet(model_patcher, diffusion_model, config)
    # DeepCache compiles nothing: a dynamic-VRAM model stays one (its clone is dynamic, accel/dynamic_vram.py),
    # and a reused step's skipped blocks simply fault no weights in.
    return clone, depth, message + (dynamic_vram.kept_note(clone) if clone is not None else "")


def _missing_names(model_patcher) -> str | None:
    """What of ComfyUI every DeepCache run reads and this ComfyUI lacks (warned once), or None."""
    import comfy.model_patcher

    gone = comfy_names.missing(comfy.model_patcher, ("create_model_options_clone",),
                               "comfy.model_patcher.create_model_options_clone")
    if not callable(getattr(model_patcher.get_model_object("model_sampling"), "percent_to_sigma", None)):
        comfy_names.warn_missing("model_sampling.percent_to_sigma")
        gone.append("model_sampling.percent_to_sigma")
    if gone:
        return (f"ComfyUI {comfy_names.comfyui_version()} has no {', '.join(gone)}, which DeepCache's sampling runs "
                "read")
    return None


def _with_wrappers(model_patcher, outer, inner, inner_type: str):
    import comfy.patcher_extension as pe

    clone = model_patcher.clone()
    # Applying DeepCache twice replaces the first one rather than nesting two caches.
    for wrapper_type in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.PREDICT_NOISE, pe.WrappersMP.DIFFUSION_MODEL,
                         pe.WrappersMP.APPLY_MODEL):
        clone.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
    clone.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer)
    clone.add_wrapper_with_key(pe.WrappersMP.PREDICT_NOISE, WRAPPER_KEY, PredictNoiseWrapper())
    clone.add_wrapper_with_key(inner_type, WRAPPER_KEY, inner)
    return clone


def _apply_dit(model_patcher, diffusion_model, config: DeepCacheConfig):
    """On a transformer, `depth` is how many blocks stay live at each end beyond the first and last one (with
    live_blocks "first only": at the start, and none at the end)."""
    name = type(diffusion_model).__name__
    if getattr(diffusion_model, "vace_blocks", None) is not None:
        # Wan VACE adds its hints after blocks in the loop itself, not through a patch: a reused span's residual
        # holds them, and the loop would add them again on top.
        return None, None, (f"{name} adds its VACE hints between blocks, where DeepCache reuses the blocks' "
                            "residual: a reused step would add them twice")
    live = config.depth + 1
    live_end = live if config.live_blocks == "first and last" else 0
    spans = dit_paths.plan_spans(diffusion_model, live, live_end)
    if not spans:
        return None, None, (f"{name} has too few blocks to keep {live} live at the start and {live_end} at the "
                            f"end (cache depth {config.depth}, live blocks {config.live_blocks}): nothing would be "
                            "reused")
    import comfy.patcher_extension as pe

    share = dit_paths.skipped_share(diffusion_model, spans)
    head = dit_paths.head_key(diffusion_model) if config.signal == FIRST_BLOCK_RESIDUAL else None
    inner = DiTApplyModelWrapper(frozenset((span.patch_name, block) for span in spans for block in span.blocks()),
                                 head)
    # APPLY_MODEL, not DIFFUSION_MODEL: every family's model call goes through it (SD3's MMDiT has no
    # DIFFUSION_MODEL wrapper in ComfyUI 0.3.75), and its arguments carry the call's transformer_options.
    clone = _with_wrappers(model_patcher, OuterSampleWrapper(config, config.depth, share), inner,
                           pe.WrappersMP.APPLY_MODEL)
    _remove_span_patches(clone)
    existing = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for span in spans:
        for block in span.blocks():
            other = existing.get((span.patch_name, block))  # another node's patch of this block keeps working
            clone.set_model_patch_replace(dit_paths.SpanBlockPatch(span, block, other), "dit",
                                          span.patch_name, block)
    if head is not None:  # the first block is live (never in a span): its patch only keeps a copy of its input
        clone.set_model_patch_replace(dit_paths.HeadBlockPatch(existing.get(head)), "dit", *head)
    skipped = ", ".join(f"{s.patch_name}s {s.first}-{s.last}" for s in spans)
    message = (f"{name}: interval {config.interval}, reused steps skip {skipped} (about "
               f"{100 * (share or 0):.0f}% of a call), {schedule_text(config)}")
    if config.start_percent >= config.end_percent and config.interval > 1:
        message += " (start_percent >= end_percent: no step may reuse features, every step runs in full)"
    return clone, config.depth, message


def _remove_span_patches(clone) -> None:
    """An earlier DeepCache's block patches off `clone` (its own copy of the model options), each block back to
    the other node's patch it wrapped, if any. Only replacing the blocks the new spans cover would leave the old
    patches on blocks outside them (a larger cache_depth, live_blocks "first and last" after "first only"), where
    they read the new call's decision by span index: blocks meant to run skipped, a residual added twice."""
    dit = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for key, patch in list(dit.items()):
        if isinstance(patch, (dit_paths.SpanBlockPatch, dit_paths.HeadBlockPatch)):
            if patch.other is None:
                del dit[key]
            else:
                dit[key] = patch.other


def _apply_unet(model_patcher, diffusion_model, config: DeepCacheConfig):
    import comfy.patcher_extension as pe

    branches = unet_paths.branch_count(diffusion_model)
    depth = min(config.depth, branches - 1)
    message = f"interval {config.interval}, branch {depth} of 0..{branches - 1}, {schedule_text(config)}"
    if config.live_blocks != "first and last":
        message += f" (live blocks {config.live_blocks!r} is for transformers: a UNet keeps its skip branch live)"
    if config.signal == FIRST_BLOCK_RESIDUAL:
        message += " (signal first block residual is for transformers: a UNet's adaptive signal is its input latent)"
    if depth != config.depth:
        message += f" (cache depth {config.depth} is beyond this UNet's deepest branch {branches - 1})"
    if config.start_percent >= config.end_percent and config.interval > 1:
        message += " (start_percent >= end_percent: no step may reuse features, every step runs in full)"
    clone = _with_wrappers(model_patcher, OuterSampleWrapper(config, depth), DiffusionModelWrapper(depth),
                           pe.WrappersMP.DIFFUSION_MODEL)
    return clone, depth, message
