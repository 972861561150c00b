"""Tiny models of ComfyUI's transformer ("DiT") families, plus a small SDXL, for tests: one file per family.

Each family is the config ComfyUI's own detection (comfy/model_detection.py) reads back from the weights,
instantiated through the matching comfy.supported_models class on the meta device, so every key name and
shape is ComfyUI's; the weights come from make_models.fill_like_init with a fixed seed (`fill_family`).
Before a file is written, the weights are detected again as UNETLoader will (`check_detection`), so a file
that would load as another class, or with keys left uninitialised, is never written.

Detection pins some widths: Flux and Chroma take 24 heads of 128 (hidden 3072), Qwen-Image takes every
size but the depth from its class defaults (hidden 3072), Lumina 2 only knows dims 2304 and 3840 (Z-Image).
Those families are "wide": Flux keeps 2 double + 2 single blocks (2 GB; the depth at which Compile Model's
default once changed its picture), Chroma, Qwen-Image and Lumina 2 one block per list (0.4-1 GB), which also
covers kinds of a single block. The others are 4-23 MB, except SDXL (231 MB: detection pins 320 channels,
2048-wide context and the per-block transformer depths). Every family is in the test set: CI runs them all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PREFIX = "model.diffusion_model."  # as the project's other UNet files; ComfyUI's loader strips it


@dataclass(frozen=True)
class Family:
    name: str         # file accel-tiny-<name>.safetensors
    detected: str     # the comfy.supported_models class detection must pick
    unet_config: dict = field(hash=False)  # exactly what detection reads back from the weights
    wide: bool = False  # detection pins full-size widths: large file (see the module docstring)

    @property
    def file_name(self) -> str:
        return f"accel-tiny-{self.name}.safetensors"


# SDXL detection matches model_channels 320, context 2048, adm 2816 and the exact per-res-block transformer
# depths, so the smallest SDXL-class UNet is Segmind Vega's depths [0, 0, 1, 1, 2, 2] (supported_models.
# Segmind_Vega, a subclass of SDXL that builds model_base.SDXL): still two transformer kinds of different
# depth like SDXL's 2 and 10. All levels stay at 320 channels (channel_mult 1) to keep the file small.
SDXL_TINY = dict(
    use_checkpoint=False, image_size=32, use_spatial_transformer=True, legacy=False,
    num_classes="sequential", adm_in_channels=2816, in_channels=4, out_channels=4, model_channels=320,
    num_res_blocks=[2, 2, 2], channel_mult=[1, 1, 1], transformer_depth=[0, 0, 1, 1, 2, 2],
    transformer_depth_output=[0, 0, 0, 1, 1, 1, 2, 2, 2], transformer_depth_middle=2,
    use_linear_in_transformer=True, context_dim=2048, use_temporal_resblock=False, use_temporal_attention=False,
)

# Flux-style double/single stream config as detection fills it in (num_heads 24, axes 16+56+56 = 128 per
# head are fixed there, so hidden is 3072; only the depths are free).
FLUX_BASE = dict(
    in_channels=16, hidden_size=3072, context_in_dim=4096, patch_size=2, axes_dim=[16, 56, 56],
    num_heads=24, mlp_ratio=4.0, theta=10000, qkv_bias=True, depth=2, depth_single_blocks=2,
)

FAMILIES = [
    Family("sdxl", "Segmind_Vega", SDXL_TINY),
    # SD3.5-style MMDiT: detection derives depth = hidden / 64 (one 64-wide head per block), so 2 blocks
    # means hidden 128. RMS q/k norm as in SD3.5 Large; T5-width context and CLIP-L+G pooled input.
    Family("sd3", "SD3", dict(
        in_channels=16, patch_size=2, out_channels=16, depth=2, input_size=None, adm_in_channels=2048,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 128}},
        num_patches=1024, pos_embed_max_size=32, qk_norm="rms", pos_embed_scaling_factor=None,
        x_block_self_attn_layers=[],
    )),
    Family("flux", "Flux", dict(FLUX_BASE, image_model="flux", out_channels=16, vec_in_dim=768, guidance_embed=True),
           wide=True),
    Family("chroma", "Chroma", dict(
        FLUX_BASE, image_model="chroma", in_channels=64, out_channels=64, in_dim=64, out_dim=3072,
        hidden_dim=5120, n_layers=5, depth=1, depth_single_blocks=1,
    ), wide=True),
    # Wan: detection sets num_heads = dim / 128, the rest comes from the weights. Text width is umT5's 4096.
    Family("wan21", "WAN21_T2V", dict(
        image_model="wan2.1", model_type="t2v", dim=256, out_dim=16, in_dim=16, num_heads=2, ffn_dim=512,
        num_layers=2, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
        cross_attn_norm=True, eps=1e-6,
    )),
    # Wan 2.2 TI2V 5B: 48 latent channels (its own VAE) is what makes detection pick WAN22_T2V.
    Family("wan22", "WAN22_T2V", dict(
        image_model="wan2.1", model_type="t2v", dim=256, out_dim=48, in_dim=48, num_heads=2, ffn_dim=512,
        num_layers=2, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
        cross_attn_norm=True, eps=1e-6,
    )),
    # HunyuanVideo: num_heads = hidden / 128 and rope axes 16+56+56, so hidden 256 is two heads.
    Family("hunyuan_video", "HunyuanVideo", dict(
        image_model="hunyuan_video", in_channels=16, patch_size=[1, 2, 2], out_channels=16, vec_in_dim=768,
        axes_dim=[16, 56, 56], meanflow=False, context_in_dim=4096, hidden_size=256, mlp_ratio=4.0,
        num_heads=2, depth=2, depth_single_blocks=2, theta=256, qkv_bias=True, byt5=False,
        guidance_embed=True, use_cond_type_embedding=False, vision_in_dim=None,
    )),
    Family("qwen_image", "QwenImage", dict(image_model="qwen_image", in_channels=64, num_layers=1), wide=True),
    # Lumina Image 2.0 (dim 2304, Gemma-2 2B text width); Z-Image would be dim 3840.
    Family("lumina2", "Lumina2", dict(
        image_model="lumina2", patch_size=2, in_channels=16, dim=2304, cap_feat_dim=2304, n_layers=1,
        qk_norm=True, n_heads=24, n_kv_heads=8, axes_dims=[32, 32, 32], axes_lens=[300, 512, 512],
        rope_theta=10000.0, ffn_dim_multiplier=4.0,
    ), wide=True),
    # LTX-Video: detection takes attention_head_dim = attn2 width / 32 (32 heads) and the cross-attention
    # width from the weights; the caption projection keeps T5's 4096 input.
    Family("ltxv", "LTXV", dict(image_model="ltxv", num_layers=2, attention_head_dim=8, cross_attention_dim=256)),
]

BY_NAME = {f.name: f for f in FAMILIES}

# The Compile Model benchmark's Flux (bench/compile_model.py --family flux): full width, 2 double + 4 single blocks
# (1.3 B parameters, 2.6 GB in fp16, 5 GB in RAM at fp32), what a 2-core 24 GB machine samples in seconds per step.
FLUX_BENCH = Family("flux-bench", "Flux", dict(FLUX_BASE, image_model="flux", out_channels=16, vec_in_dim=768,
                                                guidance_embed=True, depth=2, depth_single_blocks=4), wide=True)

# DeepCache's video speed at real scale (bench/deepcache_speed.py --family wan, on a GPU): Wan 2.1 T2V 1.3B's
# widths and depth (dim 1536 = 12 heads of 128, ffn 8960, 30 blocks), 1.4 B parameters, 2.8 GB in fp16.
WAN_BENCH = Family("wan-bench", "WAN21_T2V", dict(BY_NAME["wan21"].unet_config, dim=1536, num_heads=12, ffn_dim=8960,
                                                  num_layers=30), wide=True)


# The dataclass each Params-built family's model takes its config as, and the fields newer ComfyUIs require
# there beyond 0.3.75's, at the values their detection gives a file without the feature (0.33: `txt_ids_dims` []
# for Flux and Chroma, Chroma's `vec_in_dim` None as it has no vector_in, HunyuanVideo's `meanflow_sum` False).
PARAMS_CLASSES = {"flux": ("comfy.ldm.flux.model", "FluxParams"), "chroma": ("comfy.ldm.chroma.model", "ChromaParams"),
                  "hunyuan_video": ("comfy.ldm.hunyuan_video.model", "HunyuanVideoParams")}
NEWER_FIELDS = {"txt_ids_dims": [], "vec_in_dim": None, "meanflow_sum": False}


def config_for_this_comfyui(unet_config: dict) -> dict:
    """A config written here rather than read back by detection (the families' own, the trained digits Flux's),
    with the fields this ComfyUI's Params dataclass requires beyond 0.3.75's (NEWER_FIELDS); the config's own
    values win. Other configs come back as they are."""
    import dataclasses
    import importlib

    module, name = PARAMS_CLASSES.get(unet_config.get("image_model"), (None, None))
    if module is None:
        return unet_config
    params = getattr(importlib.import_module(module), name)
    required = {f.name for f in dataclasses.fields(params)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return {**{k: v for k, v in NEWER_FIELDS.items() if k in required}, **unet_config}


def build_model(config_name: str, unet_config: dict):
    """The family's ComfyUI model (model_base.*), on the meta device: key names and shapes, no memory."""
    import torch
    import comfy.supported_models

    unet_config = config_for_this_comfyui(unet_config)  # the family's own config, or detection's
    cfg = getattr(comfy.supported_models, config_name)(dict(unet_config))
    cfg.set_inference_dtype(torch.float32, None)
    return cfg.get_model({}, device="meta")


def fill_family(module, seed: int) -> dict:
    """make_models.fill_like_init, with norms told by module type instead of by key name.

    The name rule misses norms in these models and takes some projections for norms: LTXV's
    "adaln_single.linear" holds "ln_" and got all-ones weights (activations of 1e13 after one block),
    Qwen's "norm_out.linear" likewise; Flux-style q/k RMSNorm gains are named "scale" and Lumina's caption
    RMSNorm "cap_embedder.0", which got the 1-D init (std 0.02) and all but switched them off; the UNet's
    GroupNorms ("in_layers.0") too.
    """
    import torch
    from tools.make_models import fill_like_init, seeded_normal

    out = fill_like_init(module.state_dict(), seed)
    norms = {f"{name}.{param}" if name else param
             for name, mod in module.named_modules() if "Norm" in type(mod).__name__
             for param, _ in mod.named_parameters(recurse=False)}
    for key, tensor in out.items():
        if key in norms:
            out[key] = torch.zeros_like(tensor) if key.endswith("bias") else torch.ones_like(tensor)
        elif tensor.dim() >= 2 and bool((tensor == 1).all()):  # a projection the name rule took for a norm
            fan_in = tensor[0].numel()
            out[key] = seeded_normal(tuple(tensor.shape), fan_in ** -0.5, seed, key)
    return out


def check_detection(family: Family, state_dict: dict) -> None:
    """Detect the weights as UNETLoader does; the detected config must build exactly these keys and shapes."""
    import comfy.model_detection

    config = comfy.model_detection.model_config_from_unet(state_dict, "")
    if config is None or type(config).__name__ != family.detected:
        raise RuntimeError(f"{family.name}: detected as {type(config).__name__}, expected {family.detected}")
    detected = build_model(family.detected, config.unet_config).diffusion_model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
    if {k: tuple(v.shape) for k, v in detected.items()} != shapes:
        raise RuntimeError(f"{family.name}: the detected config builds other keys or shapes than the file's")


def family_state_dict(family: Family, seed: int) -> dict:
    model = build_model(family.detected, family.unet_config)
    state_dict = fill_family(model.diffusion_model, seed)
    check_detection(family, state_dict)
    return {PREFIX + k: v for k, v in state_dict.items()}


# The Flux LoRA touches the first double- and single-stream block's linear layers, in the kohya key format
# ("lora_unet_<diffusion model key with _>") that ComfyUI's LoraLoader maps onto any diffusion model's keys.
DIT_LORA_BLOCKS = ("double_blocks.0.", "single_blocks.0.")
DIT_LORA_RANK = 4


def dit_lora_state_dict(family_name: str, seed: int, blocks: tuple[str, ...] = DIT_LORA_BLOCKS) -> dict:
    """A LoRA of the family's generated model on the linear layers of the blocks whose keys start with `blocks`."""
    import torch
    from tools.make_models import seeded_normal

    family = BY_NAME[family_name]
    shapes = {k: tuple(v.shape) for k, v in
              build_model(family.detected, family.unet_config).diffusion_model.state_dict().items()}
    out = {}
    for key, shape in sorted(shapes.items()):
        if not key.startswith(blocks) or not key.endswith(".weight") or len(shape) != 2:
            continue
        name = "lora_unet_" + key[: -len(".weight")].replace(".", "_")
        out_features, in_features = shape
        out[name + ".lora_down.weight"] = seeded_normal((DIT_LORA_RANK, in_features), in_features ** -0.5, seed,
                                                        name + "d")
        out[name + ".lora_up.weight"] = seeded_normal((out_features, DIT_LORA_RANK), 0.5 / DIT_LORA_RANK ** 0.5,
                                                      seed, name + "u")
        out[name + ".alpha"] = torch.tensor(float(DIT_LORA_RANK))
    if not out:
        raise RuntimeError(f"the {family_name} LoRA generator matched no keys; ComfyUI's model changed")
    return out
