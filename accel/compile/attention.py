"""Attention inside compiled blocks, chosen through ComfyUI's own `optimized_attention_override` hook.

ComfyUI's memory-saving attention functions (sub-quadratic, the CPU default, and split) ask psutil or the CUDA
allocator for free memory on every call, which breaks a compiled graph into many pieces (32 graphs for one
SpatialTransformer here). Inside compiled blocks they are replaced by PyTorch's scaled_dot_product_attention,
which has the same maths and compiles into one graph. Any other attention the user chose (xformers, sage,
flash, pytorch) is kept. Eager calls are never changed. ACCEL_DISABLE_SDPA_IN_COMPILED_BLOCKS=1 turns this off.
"""
from __future__ import annotations

GRAPH_BREAKING_ATTENTION = ("attention_sub_quad", "attention_split")


def _sdpa_override(func, *args, **kwargs):
    import comfy.ldm.modules.attention as attention

    return attention.attention_pytorch(*args, **kwargs)


def compiled_block_options(allow_sdpa: bool = True) -> dict:
    """A fresh transformer_options dict for one compiled block call."""
    import comfy.ldm.modules.attention as attention

    if allow_sdpa and getattr(attention.optimized_attention, "__name__", "") in GRAPH_BREAKING_ATTENTION:
        return {"optimized_attention_override": _sdpa_override}
    return {}
