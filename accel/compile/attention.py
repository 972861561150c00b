"""Attention inside compiled blocks, chosen through ComfyUI's own `optimized_attention_override` hook.

ComfyUI's memory-saving attention functions (sub-quadratic, the CPU default, and split) ask psutil or the CUDA
allocator for free memory on every call, which breaks a compiled graph into many pieces (32 graphs for one
SpatialTransformer here). Inside compiled blocks they are replaced by PyTorch's scaled_dot_product_attention,
which has the same maths and compiles into one graph. Any other attention the user chose (xformers, sage,
flash, pytorch) is kept. Eager calls are never changed. ACCEL_DISABLE_SDPA_IN_COMPILED_BLOCKS=1 turns this off.
"""
from __future__ import annotations

from .. import comfy_names

GRAPH_BREAKING_ATTENTION = ("attention_sub_quad", "attention_split")


PYTORCH_ATTENTION = "comfy.ldm.modules.attention.attention_pytorch"  # comfy_names.NAMES


def _sdpa_override(func, *args, **kwargs):
    import comfy.ldm.modules.attention as attention

    return attention.attention_pytorch(*args, **kwargs)


def compiled_block_options(allow_sdpa: bool = True) -> dict:
    """A fresh transformer_options dict for one compiled block call. Without ComfyUI's attention_pytorch (a
    newer ComfyUI that renamed it) compiled blocks keep ComfyUI's own attention: more graphs, the same result."""
    import comfy.ldm.modules.attention as attention

    picked = getattr(attention, "optimized_attention", None)  # none: blocks.attention_swapped runs them eagerly
    if allow_sdpa and getattr(picked, "__name__", "") in GRAPH_BREAKING_ATTENTION:
        if not callable(getattr(attention, "attention_pytorch", None)):
            comfy_names.warn_missing(PYTORCH_ATTENTION)
            return {}
        return {"optimized_attention_override": _sdpa_override}
    return {}
