"""The two ways DeepCache runs a ComfyUI `UNetModel`: the full path (ComfyUI's own forward, with the deep
feature captured on the way) and the shallow path (the outer blocks only, fed the cached deep feature).

Branch `depth` d of a UNet with N input blocks is the skip connection from input block d to output block
N-1-d. The shallow path runs input blocks 0..d and output blocks N-1-d..N-1; everything between (input
blocks d+1.., the middle block, output blocks ..N-2-d) is the deep part whose result, `h` as it enters output
block N-1-d, is cached. d = 0 is DeepCache's branch 0 (only conv_in, the last output block and `out` run).

Blocks are always called the way ComfyUI's own `_forward` calls them (`forward_timestep_embed` on the
block module), so a compiled block forward installed by Compile Model is used on both paths, and per-run
state is never read inside a block.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from .. import comfy_names


def _openaimodel():
    from comfy.ldm.modules.diffusionmodules import openaimodel

    return openaimodel


# What the shallow path reads of ComfyUI (comfy_names.NAMES), checked when DeepCache is applied: a newer
# ComfyUI without one passes the model through instead of failing inside a sampling run.
UNET_CLASS = "openaimodel.UNetModel"
FUNCTIONS = "openaimodel.forward_timestep_embed, apply_control, timestep_embedding"
LAYOUT = ("UNetModel layout (input_blocks, middle_block, output_blocks, time_embed, label_emb, num_classes, "
          "model_channels, out, id_predictor, predict_codebook_ids, default_num_video_frames)")
UNET_ATTRIBUTES = ("input_blocks", "middle_block", "output_blocks", "time_embed", "num_classes", "model_channels",
                   "out", "predict_codebook_ids", "default_num_video_frames")


def is_unet(diffusion_model) -> bool:
    """DeepCache needs ComfyUI's UNetModel (SD1.x, SD2.x, SDXL, SVD, ...): a skip connection per input block."""
    unet_cls = comfy_names.attr(_openaimodel(), "UNetModel", UNET_CLASS)
    return (unet_cls is not None and isinstance(diffusion_model, unet_cls)
            and len(getattr(diffusion_model, "input_blocks", ())) > 0
            and len(diffusion_model.input_blocks) == len(getattr(diffusion_model, "output_blocks", ())))


def missing_names(unet) -> str | None:
    """What of ComfyUI the shallow path needs and this ComfyUI lacks (each warned once), or None."""
    gone = comfy_names.missing(_openaimodel(), ("forward_timestep_embed", "apply_control", "timestep_embedding"),
                               FUNCTIONS)
    wanted = UNET_ATTRIBUTES + (("label_emb",) if getattr(unet, "num_classes", None) is not None else ()) + (
        ("id_predictor",) if getattr(unet, "predict_codebook_ids", False) else ())
    gone += comfy_names.missing(unet, wanted, LAYOUT)
    if gone:
        return (f"ComfyUI {comfy_names.comfyui_version()}'s {type(unet).__name__} has no {', '.join(gone)}, which "
                "DeepCache's shallow path calls")
    return None


def branch_count(unet) -> int:
    return len(unet.input_blocks)


class DeepFeatureCapture:
    """An `output_block_patch` put first in the call's patch list: it keeps `h` as it enters output block
    `block_id`, before any other patch (FreeU, ...) changes it, so the shallow path can hand the same `h` to
    those patches again. It is plain Python between blocks, never inside one."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.h = None
        self.armed = True

    def __call__(self, h, hsp, transformer_options):
        if self.armed and transformer_options.get("block") == ("output", self.block_id):
            self.h = h.clone()  # later patches may modify h in place (FreeU scales it in place)
        return h, hsp


@contextmanager
def capture_installed(transformer_options: dict, capture: DeepFeatureCapture):
    """Put `capture` first among the call's output_block_patches, for the duration of one UNet call.

    The call's `patches` dict is replaced by a copy (never mutated: its lists may be shared), and the
    original is put back afterwards. Both paths install it, so blocks see the same patch structure on full
    and shallow steps and a compiled block has no reason to guard differently on them.
    """
    had_patches = "patches" in transformer_options
    original = transformer_options.get("patches", {})
    patches = dict(original)
    patches["output_block_patch"] = [capture, *original.get("output_block_patch", ())]
    transformer_options["patches"] = patches
    try:
        yield capture
    finally:
        if had_patches:
            transformer_options["patches"] = original
        else:
            transformer_options.pop("patches", None)


def _transformer_layers(blocks) -> int:
    """How many layers in `blocks` advance ComfyUI's transformer_index (its SpatialTransformers)."""
    from comfy.ldm.modules.attention import SpatialTransformer

    return sum(isinstance(layer, SpatialTransformer) for block in blocks if block is not None for layer in block)


def _drop_control(control, name: str, count: int) -> None:
    """ComfyUI pops one control residual per block (`apply_control`); drop those of the blocks skipped here."""
    if control is not None and name in control:
        for _ in range(min(count, len(control[name]))):
            control[name].pop()


def shallow_forward(unet, depth: int, deep_h, x, timesteps=None, context=None, y=None, control=None,
                    transformer_options=None, **kwargs):
    """`UNetModel._forward` with the deep part replaced by `deep_h`, the cached input of output block N-1-depth.

    Follows ComfyUI's loop (0.3.75 and 0.33 alike) for the blocks that do run: the emb, input-block and
    output-block patches, control residuals, transformer_index and the block tag in transformer_options,
    and 0.33's `hsp is None` case. The middle block and its patches belong to the deep part.
    """
    oam = _openaimodel()
    to = transformer_options if transformer_options is not None else {}
    to["original_shape"] = list(x.shape)
    to["transformer_index"] = 0
    patches = to.get("patches", {})
    extra = dict(time_context=kwargs.get("time_context", None),
                 num_video_frames=kwargs.get("num_video_frames", unet.default_num_video_frames),
                 image_only_indicator=kwargs.get("image_only_indicator", None))
    n = len(unet.input_blocks)
    first_out = n - 1 - depth

    t_emb = oam.timestep_embedding(timesteps, unet.model_channels, repeat_only=False).to(x.dtype)
    emb = unet.time_embed(t_emb)
    for p in patches.get("emb_patch", ()):
        emb = p(emb, unet.model_channels, to)
    if unet.num_classes is not None:
        emb = emb + unet.label_emb(y)

    hs = []
    h = x
    for i in range(depth + 1):
        to["block"] = ("input", i)
        h = oam.forward_timestep_embed(unet.input_blocks[i], h, emb, context, to, **extra)
        h = oam.apply_control(h, control, "input")
        for p in patches.get("input_block_patch", ()):
            h = p(h, to)
        hs.append(h)
        for p in patches.get("input_block_patch_after_skip", ()):
            h = p(h, to)

    # Bookkeeping as if the deep part had run: GLIGEN keys its patches on transformer_index, and the
    # output control residuals of the skipped output blocks come off the list first.
    skipped = list(unet.input_blocks[depth + 1:]) + [unet.middle_block] + list(unet.output_blocks[:first_out])
    to["transformer_index"] += _transformer_layers(skipped)
    _drop_control(control, "output", first_out)

    # Output-block patches may write into h (FreeU does): hand them a copy, so the cache stays as it was.
    writers = [p for p in patches.get("output_block_patch", ()) if not isinstance(p, DeepFeatureCapture)]
    h = deep_h.clone() if writers else deep_h
    for j in range(first_out, n):
        to["block"] = ("output", j)
        hsp = oam.apply_control(hs.pop(), control, "output")
        for p in patches.get("output_block_patch", ()):
            h, hsp = p(h, hsp, to)
        if hsp is not None:
            h = torch.cat([h, hsp], dim=1)
            del hsp
        output_shape = hs[-1].shape if hs else None
        h = oam.forward_timestep_embed(unet.output_blocks[j], h, emb, context, to, output_shape, **extra)
    h = h.type(x.dtype)
    return unet.id_predictor(h) if unet.predict_codebook_ids else unet.out(h)


# ---- compute estimate ------------------------------------------------------------------------------------

def _layer_flops(layer, positions: int, context_tokens: int) -> int:
    """Multiply-add FLOPs (x2) of one block layer per sample: convolutions and linear layers at `positions`
    output positions, attention matmuls (QK^T and AV). Norms and element-wise ops are left out (a few %)."""
    import torch.nn as nn

    total = 0
    cross_kv = set()
    for name, m in layer.named_modules():
        if hasattr(m, "to_q") and hasattr(m, "to_k") and hasattr(m, "to_v"):
            # Cross-attention when keys come from the context (another width than the queries).
            cross = m.to_k.in_features != m.to_q.in_features
            kv_tokens = context_tokens if cross else positions
            if cross:
                cross_kv.update((id(m.to_k), id(m.to_v)))
            total += 4 * positions * kv_tokens * m.to_q.out_features
    for name, m in layer.named_modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            total += 2 * m.weight.numel() * positions
        elif isinstance(m, nn.Linear):
            tokens = context_tokens if id(m) in cross_kv else 1 if "emb_layers" in name else positions
            total += 2 * m.weight.numel() * tokens
    return total


def block_flops(unet, height: int, width: int, context_tokens: int) -> tuple[list[int], int, list[int], int]:
    """Estimated FLOPs per sample of each input block, the middle block, each output block and `out`, for a
    latent of height x width. Follows the resolution through Downsample/Upsample layers."""
    oam = _openaimodel()
    res = (height, width)
    inputs, skip_res = [], []
    for block in unet.input_blocks:
        flops = 0
        for layer in block:
            if isinstance(layer, oam.Downsample):
                res = (math.ceil(res[0] / 2), math.ceil(res[1] / 2))
            flops += _layer_flops(layer, res[0] * res[1], context_tokens)
        inputs.append(flops)
        skip_res.append(res)
    middle = 0
    if unet.middle_block is not None:
        middle = sum(_layer_flops(layer, res[0] * res[1], context_tokens) for layer in unet.middle_block)
    outputs = []
    skip_res.pop()  # consumed by output block 0
    for block in unet.output_blocks:
        flops = 0
        for layer in block:
            if isinstance(layer, oam.Upsample) and skip_res:
                res = skip_res[-1]
            flops += _layer_flops(layer, res[0] * res[1], context_tokens)
        outputs.append(flops)
        if skip_res:
            skip_res.pop()
    out = sum(_layer_flops(layer, res[0] * res[1], context_tokens) for layer in unet.out)
    return inputs, middle, outputs, out


def compute_estimate(unet, depth: int, height: int, width: int, context_tokens: int) -> tuple[int, int] | None:
    """Estimated FLOPs per sample of a full UNet call and of the shallow path, or None if they cannot be told."""
    try:
        inputs, middle, outputs, out = block_flops(unet, height, width, context_tokens)
    except Exception:  # an unusual layer type (custom ops without weights, ...): report "unknown", never fail a run
        return None
    n = len(inputs)
    total = sum(inputs) + middle + sum(outputs) + out
    shallow = sum(inputs[:depth + 1]) + sum(outputs[n - 1 - depth:]) + out
    return (total, shallow) if total else None
