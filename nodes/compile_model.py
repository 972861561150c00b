from __future__ import annotations

from .common import CATEGORY, pass_through

MODES = ["default", "max-autotune-no-cudagraphs", "reduce-overhead"]
DYNAMIC = ["auto", "static", "dynamic"]
SCOPES = ["auto", "repeated blocks", "whole model"]


class CompileModel:
    DISPLAY_NAME = "Compile Model (Accel)"
    CATEGORY = CATEGORY
    DESCRIPTION = ("torch.compile for the diffusion model behind a shared compiled-graph cache. Nothing is compiled "
                   "when this node runs: compilation happens at the first sampling step that needs it.")
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "mode": (MODES, {"default": "default", "tooltip": "reduce-overhead uses CUDA graphs (CUDA only)."}),
            "dynamic": (DYNAMIC, {"default": "auto", "tooltip": "auto: static first, dynamic after a shape change."}),
            "scope": (SCOPES, {"default": "auto", "tooltip": "repeated blocks compile once per block kind."}),
        }}

    def apply(self, model, mode, dynamic, scope):
        return (pass_through("compile_model", self.DISPLAY_NAME, model, mode=mode, dynamic=dynamic, scope=scope),)


class CompileVAE:
    DISPLAY_NAME = "Compile VAE (Accel)"
    CATEGORY = CATEGORY
    DESCRIPTION = "torch.compile for the VAE's encoder and decoder, compiled at first use."
    RETURN_TYPES = ("VAE",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "vae": ("VAE",),
            "mode": (MODES, {"default": "default"}),
        }}

    def apply(self, vae, mode):
        return (pass_through("compile_vae", self.DISPLAY_NAME, vae, mode=mode),)
