"""The generated model families (tools/family_models.py) as tests use them: file, expected model class, a small
latent, and sampler conditioning with each family's real tensor widths, fed directly (no text encoders)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tools.family_models import BY_NAME


@dataclass(frozen=True)
class FamilyCase:
    name: str
    model_class: str                  # type(patcher.model).__name__ after UNETLoader (a comfy.model_base class)
    latent_shape: tuple[int, ...]     # [B, C, H, W], or [B, C, T, H, W] for video models
    context_dim: int                  # width of the text encoder's hidden states the model takes
    pooled_dim: int | None = None     # width of the pooled text vector ("pooled_output"), if the model takes one
    constants: dict = field(default_factory=dict, hash=False)  # other conditioning fields (guidance, sizes, frame rate)
    attention_mask: bool = False      # the family's text encoder also gives a token mask (LTXV's forward needs it)
    cfg: float = 5.0                  # what the family is usually sampled with
    tokens: int = 77                  # default prompt length
    steps: int = 4                    # sampling steps the tests take by default
    asset: str | None = None          # a trained model's file in bench/assets/ instead of a generated one

    @property
    def file_name(self) -> str:
        return self.asset or BY_NAME[self.name].file_name

    def conds(self, seed: int = 0, tokens: int | None = None):
        """(positive, negative) as CLIPTextEncode would give them: [[cross_attn, {extras}]]. The negative has
        zero hidden states and pooled vector, as ConditioningZeroOut gives."""
        gen = torch.Generator().manual_seed(seed)
        tokens = tokens or self.tokens
        context = torch.randn(1, tokens, self.context_dim, generator=gen)
        extras = dict(self.constants)
        if self.attention_mask:
            extras["attention_mask"] = torch.ones(1, tokens, dtype=torch.long)
        positive, negative = dict(extras), dict(extras)
        # T5/LLM-only encoders give pooled_output None, which Flux-derived models (Chroma) still look up.
        positive["pooled_output"] = negative["pooled_output"] = None
        if self.pooled_dim:
            positive["pooled_output"] = torch.randn(1, self.pooled_dim, generator=gen)
            negative["pooled_output"] = torch.zeros_like(positive["pooled_output"])
        return [[context, positive]], [[torch.zeros_like(context), negative]]


# SDXL's ADM input is CLIP-G pooled (1280) plus six size embeddings (CLIPTextEncodeSDXL's fields).
SDXL_SIZES = dict(width=1024, height=1024, crop_w=0, crop_h=0, target_width=1024, target_height=1024)

FAMILIES = [
    FamilyCase("sdxl", "SDXL", (1, 4, 16, 16), 2048, 1280, SDXL_SIZES, cfg=5.0),
    FamilyCase("sd3", "SD3", (1, 16, 16, 16), 4096, 2048, cfg=4.5),  # pooled CLIP-L + CLIP-G
    # Guidance-distilled: sampled at cfg 1 (one model call per step), guidance goes in as a conditioning input.
    # The wide families (detection pins a width of 3072 or more: tools/family_models.py) take 2 steps: CI's time.
    FamilyCase("flux", "Flux", (1, 16, 16, 16), 4096, 768, {"guidance": 3.5}, cfg=1.0, steps=2),
    # Chroma's 5120-wide approximator (pinned by detection too) took 5.6 s a step here: 1 step, at cfg 1 (one
    # model call a step; Flux and HunyuanVideo cover the batched cond/uncond call of a double/single-block DiT).
    FamilyCase("chroma", "Chroma", (1, 16, 16, 16), 4096, cfg=1.0, steps=1),
    # Video latents: [B, C, T, H, W]; 2 latent frames, 16x16 latent pixels (patch 1x2x2: 128 tokens).
    FamilyCase("wan21", "WAN21", (1, 16, 2, 16, 16), 4096, cfg=5.0),
    FamilyCase("wan22", "WAN22", (1, 48, 2, 16, 16), 4096, cfg=5.0),
    FamilyCase("hunyuan_video", "HunyuanVideo", (1, 16, 2, 16, 16), 4096, 768, {"guidance": 6.0}, cfg=1.0),
    # Qwen-Image uses Wan 2.1's 3-D latent format: an image is one frame (KSampler unsqueezes a 4-D latent).
    FamilyCase("qwen_image", "QwenImage", (1, 16, 1, 16, 16), 3584, cfg=2.5, steps=2),
    FamilyCase("lumina2", "Lumina2", (1, 16, 16, 16), 2304, cfg=4.0, steps=2),
    # LTXV has no patchify (1x1x1): 2 frames of 8x8 latent pixels are 128 tokens of 128 channels.
    FamilyCase("ltxv", "LTXV", (1, 128, 2, 8, 8), 4096, None, {"frame_rate": 25}, attention_mask=True, cfg=3.0),
]

BY_FAMILY = {f.name: f for f in FAMILIES}
# The video Wan 2.1 that bench/deepcache_quality.py --model wan trained on moving digits (dim 128, 6 blocks,
# committed): a real model's weights at a test's size, 8 latent frames of 16x16.
TRAINED_WAN = FamilyCase("digits_wan21", "WAN21", (1, 16, 8, 16, 16), 4096, cfg=5.0, asset="digits_wan21.safetensors")
ASSETS = Path(__file__).resolve().parent.parent / "bench" / "assets"


def load(comfy_nodes, family: FamilyCase):
    """The family's file through ComfyUI's own UNETLoader node (a trained model's from bench/assets/, added to
    ComfyUI's model paths as an extra_model_paths entry would)."""
    if family.asset:
        import folder_paths

        folder_paths.add_model_folder_path("diffusion_models", str(ASSETS))
    (model,) = comfy_nodes.UNETLoader().load_unet(family.file_name, "default")
    return model


def sample(model, family: FamilyCase, steps: int | None = None, seed: int = 0, tokens: int | None = None,
           cfg: float | None = None, latent_shape: tuple[int, ...] | None = None, callback=None):
    """ComfyUI's own sampling entry point (what KSampler calls), euler/normal, from an empty latent (of the
    family's small shape unless `latent_shape` says another)."""
    import comfy.sample

    latent = torch.zeros(latent_shape or family.latent_shape)
    noise = comfy.sample.prepare_noise(latent, seed)
    positive, negative = family.conds(seed, tokens)
    return comfy.sample.sample(model, noise, steps or family.steps, family.cfg if cfg is None else cfg, "euler",
                               "normal", positive, negative, latent, disable_pbar=True, seed=seed, callback=callback)
