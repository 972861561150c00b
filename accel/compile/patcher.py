"""Hooking compiled blocks into a ComfyUI ModelPatcher through its public wrapper mechanism.

`compile_model` returns a clone with an APPLY_MODEL wrapper. For the duration of each apply_model call the
wrapper gives every repeated block an instance-level `forward` that dispatches to the shared compiled entry of
its kind, and removes it afterwards. Nothing global is patched and the model is left as it was between calls,
so ComfyUI can load, partially load, unload and patch it (LoRA) as usual.

APPLY_MODEL is outside DIFFUSION_MODEL: a DIFFUSION_MODEL wrapper that runs its own UNet loop (DeepCache)
still calls the blocks through their module call, so it gets the compiled blocks whatever the node order.
"""
from __future__ import annotations

import logging
import time
import weakref

import torch

from ..cache import COMPILE_CACHE
from .attention import compiled_block_options
from .background import BACKGROUND, Capture
from .blocks import (BlockSite, block_safe_options, cannot_compile_reason, find_repeated_blocks,
                     whole_model_safe_options, whole_model_site)
from .options import CompileOptions
from .policy import device_policy, effective_options, warn_once
from .registry import REGISTRY, KindEntry, input_signature, wait_for_device
from .saved_shares import save_shares
from .step_check import StepCheck

log = logging.getLogger("comfyui_accel")
WRAPPER_KEY = "accel.compile_model"

# Block sites are found once per diffusion model object and scope (module structure does not change), and their
# registry entries once per options and device: the wrapper runs at every step, so it looks nothing up twice.
_sites: "weakref.WeakKeyDictionary[torch.nn.Module, dict[bool, list[BlockSite]]]" = weakref.WeakKeyDictionary()
_entries: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, list[KindEntry]]]" = weakref.WeakKeyDictionary()
# choose="auto": the whole-call check of each diffusion model, per the same key as its entries.
_checks: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, StepCheck]]" = weakref.WeakKeyDictionary()
# The load state (weight patches, loaded bytes) at which each diffusion model's requires_grad flags were settled.
_settled: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def compile_model(patcher, options: CompileOptions):
    """A clone of `patcher` whose diffusion model runs compiled blocks. Compiles nothing yet."""
    import comfy.patcher_extension

    model = patcher.clone()
    apply_model = comfy.patcher_extension.WrappersMP.APPLY_MODEL
    model.remove_wrappers_with_key(apply_model, WRAPPER_KEY)  # compiling twice replaces, never stacks
    model.add_wrapper_with_key(apply_model, WRAPPER_KEY, CompiledApplyModel(options))
    return model


class BlockDispatcher:
    """A block's `forward` for the length of one apply_model call: runs it through its kind's entry."""

    def __init__(self, site: BlockSite, entry: KindEntry, options: CompileOptions, allow_sdpa: bool,
                 eager_reason: str | None, progress, call: "CallRecord"):
        self.site, self.entry, self.choose, self.allow_sdpa = site, entry, options.choose, allow_sdpa
        self.eager_reason, self.progress, self.call = eager_reason, progress, call

    def __call__(self, *args, **kwargs):
        block, entry, call = self.site.module, self.entry, self.call
        call.blocks += 1
        if call.captures is not None and not self.eager_reason:
            waiting = self._background(block, entry, call, args, kwargs)
            if waiting and not call.profile:
                return entry.run_eager(block, args, kwargs, waiting)
        if call.profile:  # the first call in auto mode: eager, each kind's share of the call timed
            wait_for_device(call.device_type)
            start = time.perf_counter()
            out = entry.forward(block, *args, **kwargs)
            wait_for_device(call.device_type)
            call.kind_seconds[entry.key] = call.kind_seconds.get(entry.key, 0.0) + time.perf_counter() - start
            return out
        if call.eager_check:  # the eager side of the whole-call check: ComfyUI's own forward, uncounted
            return entry.forward(block, *args, **kwargs)
        if self.eager_reason:
            return entry.run_eager(block, args, kwargs, self.eager_reason)
        make_call = self._make_call(args, kwargs)
        if make_call is None:
            return entry.run_eager(block, args, kwargs, "another node patched the attention or the UNet")
        first_compile = entry.compiles == 0
        out = entry.run(block, make_call, args, kwargs, self.choose)
        if first_compile and entry.compiles and self.progress is not None:
            self.progress.update(1)
        return out

    def _make_call(self, args: tuple, kwargs: dict):
        """A function building fresh (args, kwargs) for a compiled call of this block, or None when this call
        must run eagerly (another node patched what the block computes)."""
        if self.site.call_signature is None:
            return lambda: (args, kwargs)
        bound = self.site.call_signature.bind(*args, **kwargs)
        options = bound.arguments.get(self.site.options_arg) or {}
        safe = whole_model_safe_options(options) if self.site.whole_model else block_safe_options(options)
        if safe is None:
            return None

        def make_call():
            # fresh each call: blocks write into their transformer_options
            bound.arguments[self.site.options_arg] = compiled_block_options(self.allow_sdpa)
            return bound.args, bound.kwargs

        return make_call

    def _background(self, block, entry: KindEntry, call: "CallRecord", args: tuple, kwargs: dict) -> str | None:
        """Why this block runs eagerly while its kind compiles in the background, or None when it does not.
        The first block of a kind that must be compiled cold is captured for the child process."""
        capture = call.captures.get(entry.key)
        if entry.waiting_for_background and capture is None:
            return "compiling in the background"
        if capture is None:
            if not entry.needs_background():
                return None
            capture = Capture(entry, block, self.site.attribute, torch.is_grad_enabled(),
                              torch.is_inference_mode_enabled())
        make_call = self._make_call(args, kwargs)
        if make_call is None:
            return "compiling in the background" if entry.waiting_for_background else None  # capture a later one
        call_args, call_kwargs = make_call()
        capture.add_call(input_signature(call_args, call_kwargs), call_args, call_kwargs)
        call.captures[entry.key] = capture
        entry.background = "queued"
        return "compiling in the background"


class CallRecord:
    """One apply_model call: how it runs (profile, or the eager side of the whole-call check), what it ran."""

    def __init__(self, device_type: str, profile: bool = False, eager_check: bool = False,
                 background: bool = False):
        self.device_type, self.profile, self.eager_check = device_type, profile, eager_check
        self.captures: dict[tuple, Capture] | None = {} if background else None  # for the background compiler
        self.blocks = 0
        self.kind_seconds: dict[tuple, float] = {}  # profile calls: seconds per kind key


class CompiledApplyModel:
    """The APPLY_MODEL wrapper. Holds only the options: all compiled state lives in the process-wide registry."""

    def __init__(self, options: CompileOptions):
        self.options = options

    def __call__(self, executor, *args, **kwargs):
        base_model = executor.class_obj
        diffusion_model = base_model.diffusion_model
        x = args[0] if args else kwargs["x"]
        policy = device_policy(x.device)
        if not policy.allows("compile"):
            warn_once(x.device, "compile", f"the model runs eagerly: {policy.explain('compile')}")
            return executor(*args, **kwargs)
        options = effective_options(self.options, policy, x.device)
        allow_sdpa = policy.allows("sdpa_in_compiled_blocks")
        sites = self._sites_for(diffusion_model)
        _settle_requires_grad(base_model, diffusion_model)
        entries = self._entries_for(base_model, diffusion_model, sites, options, x.device)
        check = self._check_for(base_model, diffusion_model, options, x.device) if options.choose == "auto" else None
        background = options.compiles_in_background and policy.allows("background_compile")
        if background:
            BACKGROUND.poll()  # a finished child hands its kinds back here
            # once every kind is decided and none waits, blocks dispatch as without a background compiler
            background = any(e.background is None or e.waiting_for_background for e in entries)
        if check is not None and check.verdict == "eager":
            return executor(*args, **kwargs)  # whole calls were not faster compiled: no dispatch at all
        # Auto mode's first call of a model runs eagerly, timing each kind's share of it, if a kind has neither a
        # path nor a share (from this or an earlier process): kinds too small to matter are then never compiled.
        profile = check is not None and not check.profiled and any(
            e.auto_path is None and e.failure is None and e.call_share is None for e in entries)
        # The whole-call check, once kinds have paths (a call that compiles or times is no sample; see below).
        checking = (check is not None and check.verdict is None and not profile
                    and any(e.path == "compiled" for e in entries)
                    and not any(e.waiting_for_background for e in entries))
        # Kinds never compiled (another model's, other options') go to the background even during the check; a
        # call that sends any is no sample (_settled_state), and no call is one while kinds wait for a child.
        call = CallRecord(x.device.type, profile=profile, eager_check=checking and check.next_path() == "eager",
                          background=background)
        # the progress bar counts kinds compiled in this call's process (those loading the child's work included)
        progress = None if profile else _progress_bar(len({
            e.key for e in entries if e.compiles == 0 and e.path != "eager"
            and (not background or e.background in ("not needed", "done", "failed"))}))
        # A fully loaded model (ComfyUI's model_lowvram flag unset) has every weight on the compute device, so
        # the per-block offload check is only needed after a partial load.
        partial = getattr(base_model, "model_lowvram", True)
        before = _settled_state(entries) if checking else None
        installed = []
        try:
            for site, entry in zip(sites, entries):
                reason = cannot_compile_reason(site.module, x.device) if partial else None
                site.module.__dict__[site.attribute] = BlockDispatcher(site, entry, options, allow_sdpa, reason,
                                                                       progress, call)
                installed.append(site)
            if checking or profile:
                wait_for_device(x.device.type)
            start = time.perf_counter()
            out = executor(*args, **kwargs)
            if checking or profile:
                wait_for_device(x.device.type)
            seconds = time.perf_counter() - start
        finally:
            for site in installed:
                site.module.__dict__.pop(site.attribute, None)
        if profile:
            check.profiled = True
            measured = {e.key: e for e in entries if e.key in call.kind_seconds}  # one per kind, not per block
            for entry in measured.values():
                entry.note_call_share(call.kind_seconds[entry.key] / seconds)
            save_shares(x.device.type, {e.share_id: e.call_share for e in measured.values()})
        if call.captures:
            self._launch_background(list(call.captures.values()), x.device.type)
        # A call that compiled or timed a kind is no sample of either path's speed.
        if checking and _settled_state(entries) == before:
            check.record((tuple(x.shape), str(x.dtype), call.blocks), "eager" if call.eager_check else "compiled",
                         seconds)
        return out

    @staticmethod
    def _launch_background(captures: list[Capture], device_type: str) -> None:
        # after a profile call, kinds too small to matter are eager for good: nothing to compile for them
        wanted = [c for c in captures if c.entry.auto_path is None and c.entry.failure is None]
        for capture in captures:
            if capture not in wanted:
                capture.entry.background = "not needed"
        BACKGROUND.launch(wanted, COMPILE_CACHE.environment(device_type).dir)  # kinds it cannot send: compiled here

    def _check_for(self, base_model, diffusion_model: torch.nn.Module, options: CompileOptions,
                   device: torch.device) -> StepCheck:
        by_key = _checks.setdefault(diffusion_model, {})
        key = (self.options.whole_model, options, str(device))
        if key not in by_key:
            by_key[key] = StepCheck(_model_label(base_model))
            REGISTRY.note_step_check(by_key[key])
        return by_key[key]

    def _entries_for(self, base_model, diffusion_model: torch.nn.Module, sites: list[BlockSite],
                     options: CompileOptions, device: torch.device) -> list[KindEntry]:
        by_key = _entries.setdefault(diffusion_model, {})
        key = (self.options.whole_model, options, str(device))
        if key not in by_key:
            by_key[key] = [REGISTRY.entry(site.kind, site.forward, options, device) for site in sites]
            REGISTRY.note_model(_model_label(base_model), {e.key for e in by_key[key]})
        return by_key[key]

    def _sites_for(self, diffusion_model: torch.nn.Module) -> list[BlockSite]:
        by_scope = _sites.setdefault(diffusion_model, {})
        whole = self.options.whole_model
        if whole not in by_scope:
            by_scope[whole] = [whole_model_site(diffusion_model)] if whole else find_repeated_blocks(diffusion_model)
            log.info("[Accel] Compile Model: %d blocks of %d kinds in %s", len(by_scope[whole]),
                     len({s.kind for s in by_scope[whole]}), type(diffusion_model).__name__)
        return by_scope[whole]


def _model_label(base_model) -> str:
    return f"{type(base_model).__name__}@{id(base_model):x}"


def _settled_state(entries: list[KindEntry]) -> tuple[int, int, int]:
    """Compiles so far, kinds with a path chosen and kinds sent to a background compile, over a model's entries:
    unchanged by a call that only ran."""
    return (sum(e.compiles for e in entries), sum(e.auto_path is not None or e.failure is not None for e in entries),
            sum(e.background is not None for e in entries))


def _settle_requires_grad(base_model, diffusion_model: torch.nn.Module) -> None:
    # ComfyUI 0.3.75 leaves requires_grad=True on the UNet's parameters while its weight patches (LoRA,
    # Swap Weights) create requires_grad=False ones; compiled graphs guard on that flag, so the first patch
    # would recompile every block. Inference never needs gradients; newer ComfyUI sets this itself.
    # Parameters change only when ComfyUI (un)patches or (re)loads weights, so the scan runs once per load state.
    state = tuple(getattr(base_model, name, None) for name in
                  ("current_weight_patches_uuid", "model_loaded_weight_memory", "lowvram_patch_counter"))
    if _settled.get(diffusion_model) == state:
        return
    if any(p.requires_grad for p in diffusion_model.parameters()):
        diffusion_model.requires_grad_(False)
    _settled[diffusion_model] = state


def _progress_bar(pending: int):
    """ComfyUI's progress bar over the block kinds still to compile, when some are (none when warm)."""
    if not pending:
        return None
    import comfy.utils

    return comfy.utils.ProgressBar(pending)
