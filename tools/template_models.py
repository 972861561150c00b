"""The real model files the pack's templates name, with the links ComfyUI's own templates give for them, and the
generated stand-ins the tests put under those names.

A user who opens a template gets the file names of ComfyUI's official templates for that model (their links are
embedded in the template, so the frontend's missing-models dialog offers them). Tests cannot download those
files: `make setup` writes a stand-in for each under the same name into a folder of its own
(`standins_dir()`: models/accel-template-standins/<folder>/ of the ComfyUI under test, which ComfyUI itself never
scans; test servers add it to their model paths). A stand-in is the same architecture at test size, loaded by
the same loader node:
- checkpoints: a small UNet of the family with its real text encoders (CLIP-L, CLIP-G) and VAE, in one file;
- diffusion models and CLIP-L: a link to the project's generated test model of that family (tools/family_models.py);
- VAEs: the family's VAE class (Wan 2.1's at a narrow width: ComfyUI reads its width from the weights);
- LoRAs: a LoRA of the generated model's first block;
- text encoders too large to generate here (T5-XXL, umT5-XXL, Qwen2.5-VL 7B): a placeholder under the name, so
  the template opens without a missing-model warning; the tests replace those nodes with conditioning tensors
  of the right width (tools/server_nodes/accel_test_inputs) and never load it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STANDINS_FOLDER = "accel-template-standins"
HF = "https://huggingface.co/"


@dataclass(frozen=True)
class RealModel:
    name: str  # the file name, as ComfyUI's official templates name it
    directory: str  # ComfyUI's model folder it goes in
    url: str  # where ComfyUI's official templates download it from
    standin: str  # how the tests' stand-in is made: see STANDIN_KINDS

    def link(self) -> dict:
        """The entry ComfyUI's templates carry for it (a loader node's properties.models, the workflow's models)."""
        return {"name": self.name, "url": self.url, "directory": self.directory}


# standin kinds: "checkpoint:<family>:<seed>", "link:<folder>/<generated file>", "vae:<kind>:<seed>",
# "lora:<family>:<seed>", "placeholder"
REAL_MODELS = [
    RealModel("v1-5-pruned-emaonly-fp16.safetensors", "checkpoints",
              HF + "Comfy-Org/stable-diffusion-v1-5-archive/resolve/main/v1-5-pruned-emaonly-fp16.safetensors",
              "checkpoint:sd15:201"),
    RealModel("sd_xl_base_1.0.safetensors", "checkpoints",
              HF + "stabilityai/stable-diffusion-xl-base-1.0/resolve/main/sd_xl_base_1.0.safetensors",
              "checkpoint:sdxl:202"),
    RealModel("sd_xl_turbo_1.0_fp16.safetensors", "checkpoints",
              HF + "stabilityai/sdxl-turbo/resolve/main/sd_xl_turbo_1.0_fp16.safetensors", "checkpoint:sdxl:203"),
    RealModel("flux1-dev.safetensors", "diffusion_models",
              HF + "Comfy-Org/flux1-dev/resolve/main/flux1-dev.safetensors",
              "link:diffusion_models/accel-tiny-flux.safetensors"),
    RealModel("clip_l.safetensors", "text_encoders",
              HF + "comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors",
              "link:clip/accel-clip-l.safetensors"),
    RealModel("t5xxl_fp16.safetensors", "text_encoders",
              HF + "comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp16.safetensors", "placeholder"),
    RealModel("ae.safetensors", "vae",
              HF + "Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors",
              "vae:flux:204"),
    RealModel("wan2.1_t2v_1.3B_fp16.safetensors", "diffusion_models",
              HF + "Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/diffusion_models/"
                   "wan2.1_t2v_1.3B_fp16.safetensors",
              "link:diffusion_models/accel-tiny-wan21.safetensors"),
    RealModel("umt5_xxl_fp8_e4m3fn_scaled.safetensors", "text_encoders",
              HF + "Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/text_encoders/"
                   "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "placeholder"),
    RealModel("wan_2.1_vae.safetensors", "vae",
              HF + "Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/vae/wan_2.1_vae.safetensors",
              "vae:wan21:205"),
    RealModel("qwen_image_fp8_e4m3fn.safetensors", "diffusion_models",
              HF + "Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/diffusion_models/"
                   "qwen_image_fp8_e4m3fn.safetensors",
              "link:diffusion_models/accel-tiny-qwen_image.safetensors"),
    RealModel("qwen_2.5_vl_7b_fp8_scaled.safetensors", "text_encoders",
              HF + "Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/text_encoders/"
                   "qwen_2.5_vl_7b_fp8_scaled.safetensors", "placeholder"),
    RealModel("qwen_image_vae.safetensors", "vae",
              HF + "Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/vae/qwen_image_vae.safetensors",
              "vae:wan21:206"),
    RealModel("Qwen-Image-Lightning-8steps-V1.0.safetensors", "loras",
              HF + "lightx2v/Qwen-Image-Lightning/resolve/main/Qwen-Image-Lightning-8steps-V1.0.safetensors",
              "lora:qwen_image:207"),
]
BY_NAME = {m.name: m for m in REAL_MODELS}
# The text encoders the tests never load (too large to generate here): their nodes are replaced by conditioning.
PLACEHOLDERS = {m.name for m in REAL_MODELS if m.standin == "placeholder"}


def standins_dir(comfy_dir: Path) -> Path:
    """Where the stand-ins of the ComfyUI at `comfy_dir` live: one folder per model folder below it."""
    return comfy_dir / "models" / STANDINS_FOLDER


def links_of(widget_values) -> list[dict]:
    """The model links of the real files among a node's widget values (what its properties.models holds)."""
    return [BY_NAME[v].link() for v in widget_values or () if isinstance(v, str) and v in BY_NAME]
