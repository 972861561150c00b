"""Which parts of a diffusion model are compiled, and what makes two of them the same kind.

Regional compilation compiles the repeated blocks (UNet ResBlocks and SpatialTransformers, DiT blocks), so
identical blocks share one compiled graph. A block's *kind* is its class plus the names, shapes and dtypes of its
parameters: two blocks of one kind run the same compiled code with their own weights as graph inputs.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import comfy_names
from ..families import UNET_BLOCK_CLASSES
from .shapes import CompiledCall, compiled_call, steady_unit_strides

CONTAINER_CLASSES = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)

# transformer_options entries that change what a block computes. When one is present the call runs eagerly:
# these are other nodes' patches (IPAdapter, attention replacements) that a compiled graph would bake in.
BLOCK_PATCH_KEYS = ("attn1_patch", "attn1_output_patch", "attn2_patch", "attn2_output_patch", "middle_patch")

# ComfyUI's attention functions as the module globals blocks read at each call: comfy.ldm.modules.attention's two,
# and the copies family modules import (flux.math, wan.model, qwen_image.model, ...). Other nodes swap them in
# place: skip-guidance nodes for one model call, attention patch nodes (KJNodes' Sage attention) for a run. A graph
# a child saved keeps the function it was compiled with (torch drops the guards on globals from a saved function),
# and one Dynamo compiled here would be compiled again at each swap (a skip-guidance node's function is new at each
# prompt). So a block call under a swap runs eagerly, as one whose options carry another node's attention patch.
ATTENTION_GLOBALS = ("optimized_attention", "optimized_attention_masked")
ATTENTION_MODULE = "comfy.ldm.modules.attention"  # where ComfyUI's own attention functions live
_picked: tuple = ()  # ComfyUI's picks: ATTENTION_MODULE's two globals at the first check that finds its own there
_attention_holders: list = []  # (module, name) of every such global in comfy.ldm's modules (scan_attention_holders)
_attention_seen: tuple = (None, False)  # (the objects in place at the last check, swapped)


@dataclass(frozen=True)
class BlockKind:
    class_name: str
    signature: str  # digest of (parameter name, shape, dtype) for every parameter and buffer
    label: str  # short, human-readable: class and channel counts

    @classmethod
    def of(cls, module: torch.nn.Module, method: str = "forward") -> "BlockKind":
        items = [(name, tuple(t.shape), str(t.dtype)) for name, t in
                 list(module.named_parameters()) + list(module.named_buffers())]
        digest = hashlib.sha1(repr(sorted(items)).encode()).hexdigest()[:12]
        shapes = [shape for name, shape, _ in items if name.endswith("weight") and len(shape) >= 2]
        details = [f"{shapes[0][1]}->{shapes[-1][0]}" if shapes else "-", *_depth_and_heads(module)]
        suffix = "" if method == "forward" else f".{method}"
        return cls(type(module).__qualname__ + suffix, digest,
                   f"{type(module).__name__}{suffix}[{', '.join(details)}]")


HEADS_ATTRIBUTES = ("heads", "num_heads", "n_heads")


def _depth_and_heads(module: torch.nn.Module) -> list[str]:
    """What a person tells blocks of one class apart by, beyond channels: how many sub-blocks it repeats (SDXL's
    SpatialTransformers of depth 2 and 10) and its attention heads."""
    depth = max((len(m) for m in module.modules() if isinstance(m, torch.nn.ModuleList) and m is not module
                 and len({type(c) for c in m}) == 1), default=1)
    heads = next((value for m in module.modules() for name in HEADS_ATTRIBUTES
                  if isinstance(value := getattr(m, name, None), int) and not isinstance(value, bool)), None)
    return ([f"depth {depth}"] if depth > 1 else []) + ([f"{heads} heads"] if heads else [])


@dataclass
class BlockSite:
    path: str
    module: torch.nn.Module
    kind: BlockKind
    attribute: str = "forward"  # the method that runs compiled
    # "transformer_options" when the forward takes them, as a named argument or through **kwargs
    options_arg: str | None = field(default=None)
    whole_model: bool = False

    @property
    def forward(self):
        return getattr(type(self.module), self.attribute)

    @functools.cached_property
    def call_signature(self) -> inspect.Signature | None:
        """The forward's signature without `self`, to find a transformer_options argument passed by position;
        None when the forward takes them only through **kwargs (then always by keyword)."""
        sig = inspect.signature(self.forward)
        if not self.options_arg or self.options_arg not in sig.parameters:
            return None
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def options_of_call(self, args: tuple, kwargs: dict) -> tuple[dict | None, Callable | None]:
        """This call's transformer_options, and a function giving the call's (args, kwargs) with other options in
        their place; (None, None) when options cannot be given: the forward takes none, or takes them only
        through **kwargs and this call passes none (what receives the **kwargs may not accept them)."""
        name = self.options_arg
        if not name:
            return None, None
        if name in kwargs:
            return kwargs[name], lambda options: (args, {**kwargs, name: options})
        if self.call_signature is None:
            return None, None
        bound = self.call_signature.bind(*args, **kwargs)

        def with_options(options: dict) -> tuple[tuple, dict]:
            bound.arguments[name] = options
            return bound.args, bound.kwargs

        return bound.arguments.get(name), with_options


    def compiled_call(self, args: tuple, kwargs: dict, block_options: dict) -> CompiledCall | str:
        """The one answer to whether this call of the block may run compiled, before it runs: its compiled call
        (shapes.CompiledCall: fresh transformer_options with `block_options`, the call's attention choice, in
        them; steady strides; the signature), or why it runs eagerly: another node swapped ComfyUI's attention
        function, or its options carry another node's patch (PATCHED, or UNKNOWN_PATCH naming it). Offloaded
        weights are answered once per call, when the dispatcher is installed (cannot_compile_reason)."""
        if attention_swapped():
            return PATCHED
        options, with_options = self.options_of_call(args, kwargs)
        if with_options is None:
            return compiled_call(args, kwargs, lambda: steady_unit_strides(args, kwargs))
        options = options or {}
        if self.whole_model:
            safe = whole_model_safe_options(options)
            if safe is None:
                return PATCHED
        else:
            reason = block_patch_reason(options)
            if reason:
                return reason
            safe = {}

        def fresh() -> tuple[tuple, dict]:  # fresh each call: blocks write into their transformer_options
            return steady_unit_strides(*with_options({**safe, **block_options}))

        return compiled_call(*with_options({**safe, **block_options}), again=fresh)


def _transformer_options_arg(module: torch.nn.Module, attribute: str) -> str | None:
    """A forward that takes transformer_options by name, or may get them through **kwargs: SD3's JointBlock
    forwards (*args, **kwargs) to the function that reads them. Either way compiled calls get fresh options
    (dispatch.py), so per-step values stay out of the graph's guards and attention that reads free memory on
    each call (the CPU default) is replaced inside compiled blocks (attention.py)."""
    params = inspect.signature(getattr(type(module), attribute)).parameters
    if "transformer_options" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "transformer_options"
    return None


def find_repeated_blocks(model: torch.nn.Module) -> list[BlockSite]:
    """The outermost repeated blocks of `model`, in module order.

    A block class counts as repeated when a ModuleList holds two or more of it, or when the model's own top-level
    list holds it alone (a DiT's `double_blocks` with depth 1 in a small or pruned variant): those are the model's
    blocks, and a kind of one block still shares its graph with every model of that architecture."""
    chosen: list[tuple[str, torch.nn.Module]] = []
    repeated_classes = set()
    top_level = {id(child) for child in model.children()}
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and (len(module) >= 2 or (len(module) == 1
                                                                               and id(module) in top_level)):
            classes = {type(child) for child in module}
            if len(classes) == 1 and not issubclass(next(iter(classes)), CONTAINER_CLASSES):
                repeated_classes |= classes
    for path, module in model.named_modules():
        if not path:
            continue
        if type(module).__name__ in UNET_BLOCK_CLASSES or type(module) in repeated_classes:
            if any(path.startswith(outer + ".") for outer, _ in chosen):
                continue  # inside a block already chosen
            chosen.append((path, module))
    return [BlockSite(path, module, BlockKind.of(module), "forward", _transformer_options_arg(module, "forward"))
            for path, module in chosen]


def whole_model_site(model: torch.nn.Module) -> BlockSite:
    """The whole diffusion model: its `_forward`, inside ComfyUI's DIFFUSION_MODEL wrappers, so other nodes'
    wrappers keep running eagerly around it instead of being traced into the graph."""
    attribute = "_forward" if hasattr(type(model), "_forward") else "forward"
    return BlockSite("", model, BlockKind.of(model), attribute, _transformer_options_arg(model, attribute), True)


# What ComfyUI's sampler itself puts into every model call's transformer_options (0.3.75 and 0.33, checked with a
# wrapper on a plain KSampler run), and the pack's own keys ("accel_..."): nothing another node set for the model.
SAMPLER_OPTION_KEYS = frozenset({"callbacks", "cond_or_uncond", "sample_sigmas", "sigmas", "uuids", "wrappers",
                                 "prefetch_dynamic_vbars", "patches", "patches_replace"})
# Of those, what a model's own forward reads outside its blocks, so a whole-model call keeps them: which rows of
# the batch are cond and which uncond (0.33's SeedVR swaps its halves by it, Trellis2 finds its uncond slots), and
# the sigmas (HunyuanVideo's meanflow variants embed the next sigma). The sigmas are tensors, graph inputs whose
# values never recompile; cond_or_uncond is guarded by value where a forward reads it, and changes with the batch.
MODEL_READ_SAMPLER_KEYS = ("cond_or_uncond", "sigmas", "sample_sigmas")


def whole_model_safe_options(transformer_options: dict) -> dict | None:
    """Like block_safe_options, for the whole model: any patch (FreeU, input/output block patches) makes the
    call eager, because the UNet loop itself applies them. So does any option another node set for the model's
    own code to read (ScaleROPE's "rope_options", Flux and Wan read them outside the blocks; Chroma Radiance's),
    which fresh options would drop. Else the sampler's values the model's forward reads, which the call's fresh
    options keep (MODEL_READ_SAMPLER_KEYS)."""
    if transformer_options.get("patches") and any(transformer_options["patches"].values()):
        return None
    if transformer_options.get("patches_replace"):  # the model's own block loop calls DiT block patches
        return None
    if any(key not in SAMPLER_OPTION_KEYS and not key.startswith("accel_") for key in transformer_options):
        return None
    if block_safe_options(transformer_options) is None:
        return None
    return {key: transformer_options[key] for key in MODEL_READ_SAMPLER_KEYS if key in transformer_options}


def block_safe_options(transformer_options: dict) -> dict | None:
    """`{}` when the real transformer_options hold nothing a block acts on, so a compiled block may get fresh
    options of its own instead (with what this returns in them); None when the call must run eagerly (another
    node patched the attention, or holds a patch the pack does not know: `block_patch_reason`).

    Fresh options keep per-step and per-prompt values (sigmas, cond_or_uncond, block ids, uuids, wrappers) out
    of the compiled graph's guards, so they never trigger recompiles.
    """
    return None if block_patch_reason(transformer_options) else {}


# Patches the model's own forward applies around its blocks (the UNet's loop and timestep embedding, a DiT's
# post-input and per-block loop patches, Lumina's noise refiner; ComfyUI 0.3.75 and 0.33): a block computes as
# without them, so it may run compiled. A patch key in neither this list nor BLOCK_PATCH_KEYS is one the pack does
# not know (0.33's "mlp_patch" acts inside Cosmos blocks): its blocks run eagerly, so it applies.
MODEL_LOOP_PATCH_KEYS = ("input_block_patch", "input_block_patch_after_skip", "output_block_patch",
                         "middle_block_after_patch", "emb_patch", "forward_timestep_embed_patch", "post_input",
                         "double_block", "noise_refiner")
PATCHED = "another node patched the attention or the UNet"
UNKNOWN_PATCH = "another node's patch the pack does not know"  # + ": <key> (<the patch's class>)"


def block_patch_reason(transformer_options: dict) -> str | None:
    """Why a block call with these options must run eagerly (PATCHED, or UNKNOWN_PATCH naming the patch), or None.

    A DiT's per-block replace patches ("dit") are called by the model's block loop, which then runs the block
    (DeepCache's span patches, PuLID-style nodes): the block computes as without them, so it may run compiled.
    Any other replacement (a UNet's attn1/attn2, ...) acts inside the block."""
    if any(value for key, value in (transformer_options.get("patches_replace") or {}).items() if key != "dit"):
        return PATCHED
    if transformer_options.get("optimized_attention_override") is not None:
        return PATCHED
    patches = transformer_options.get("patches") or {}
    if any(patches.get(key) for key in BLOCK_PATCH_KEYS):
        return PATCHED
    unknown = sorted(key for key, value in patches.items()
                     if value and key not in MODEL_LOOP_PATCH_KEYS and key not in BLOCK_PATCH_KEYS)
    if unknown:
        first = patches[unknown[0]]
        patch = first[0] if isinstance(first, (list, tuple)) and first else first
        owner = patch if hasattr(patch, "__qualname__") else type(patch)  # a function, or a patch object's class
        return f"{UNKNOWN_PATCH}: {', '.join(unknown)} ({owner.__module__}.{owner.__qualname__})"
    return None


def attention_swapped() -> bool:
    """True while another node holds one of ComfyUI's attention globals (ATTENTION_GLOBALS): a function that is
    not ComfyUI's own, or not one of its picks (the child that compiles saw those). The picks are taken at the
    first check that finds ComfyUI's own functions in place, so a node's swap in effect then (a skip-guidance
    node's, for its one model call) is never taken for them. Asked at every block call: a getattr for each of a
    few dozen globals."""
    global _picked, _attention_seen
    if not _picked:
        attention = sys.modules.get(ATTENTION_MODULE)
        main = tuple(getattr(attention, name, None) for name in ATTENTION_GLOBALS)
        if attention is not None and all(_comfyui_own(f) for f in main):
            _picked, _attention_seen = main, (None, False)
    if not _attention_holders:
        scan_attention_holders()
    seen, swapped = _attention_seen
    current = tuple(getattr(module, name, None) for module, name in _attention_holders)
    if seen is None or len(seen) != len(current) or any(a is not b for a, b in zip(current, seen)):
        swapped = any(not _comfyui_own(f) or (_picked and not any(f is p for p in _picked)) for f in current)
        _attention_seen = (current, swapped)
    return swapped


def scan_attention_holders() -> None:
    """Find the globals attention_swapped watches: ATTENTION_GLOBALS in comfy.ldm's modules. Run when Compile
    Model is applied (the model's family modules are imported by then: it has been loaded), not inside a model
    call, where the scan's milliseconds (thousands of modules in a server) counted in the call's timings: the
    profile then took a small model's blocks for too small a share to compile."""
    global _attention_holders, _attention_seen
    attention = sys.modules.get(ATTENTION_MODULE)
    if attention is not None:  # a newer ComfyUI without them: every block call counts as swapped (eager)
        comfy_names.missing(attention, ATTENTION_GLOBALS[:1], f"{ATTENTION_MODULE}.{ATTENTION_GLOBALS[0]}")
        comfy_names.missing(attention, ATTENTION_GLOBALS[1:], f"{ATTENTION_MODULE}.{ATTENTION_GLOBALS[1]}")
    # sys.modules.copy(), not list(sys.modules.items()): a copy is one C call that no import on another thread (a
    # server's) can interleave with; iterating raised "dictionary changed size during iteration" in a template run
    _attention_holders = [(module, name) for module_name, module in sys.modules.copy().items()
                          if module is not None and module_name.startswith("comfy.ldm.")
                          for name in ATTENTION_GLOBALS if name in vars(module)]
    _attention_seen = (None, False)


def _comfyui_own(function) -> bool:
    return getattr(function, "__module__", None) == ATTENTION_MODULE


def cannot_compile_reason(module: torch.nn.Module, device: torch.device) -> str | None:
    """Why this block must run eagerly in the model's current load state, or None.

    ComfyUI's partial loading (lowvram) leaves some weights on the offload device and casts them per call, and
    its LoRA-on-lowvram path adds per-weight patch functions; compiling those would bake the offload state into
    the graph or recompile once per weight, so such blocks run eagerly until ComfyUI loads them fully.
    """
    for sub in module.modules():
        if getattr(sub, "weight_function", None) or getattr(sub, "bias_function", None):
            return "weights patched per call (LoRA on a partially loaded model)"
        for param in sub.parameters(recurse=False):
            if param.device != device:
                return f"weights on {param.device}, computing on {device} (partially loaded)"
    return None
