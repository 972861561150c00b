from __future__ import annotations

from ..accel import telemetry
from ..accel.compile import CompileOptions, compile_model, compile_vae
from ..accel.compile.options import CHOOSE, DYNAMIC, MODES, SCOPES
from .common import CATEGORY, OWNER_INPUTS, log, status_owner


class CompileModel:
    DISPLAY_NAME = "Compile Model (Accel)"
    CATEGORY = CATEGORY
    DESCRIPTION = ("torch.compile for the diffusion model behind a shared compiled-graph cache. Nothing is compiled "
                   "when this node runs: compilation happens at the first sampling step that needs it, with "
                   "choose=auto in a background process while the blocks run eagerly.")
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model to compile: from a model loader, a LoRA loader or "
                                           "any node that outputs a MODEL."}),
            "mode": (list(MODES), {"default": "default",
                                   "tooltip": "default suits most uses. max-autotune-no-cudagraphs autotunes "
                                              "kernels (longer compiles); reduce-overhead uses CUDA graphs (CUDA "
                                              "only); a mode the device lacks compiles as default. low-memory: no "
                                              "CUDA graphs or autotuning, blocks only, no compile worker or "
                                              "background processes."}),
            "dynamic": (list(DYNAMIC), {"default": "auto",
                                        "tooltip": "auto: static first, dynamic after a shape change (image size, "
                                                   "batch, prompt length). static: one graph per shape. dynamic: "
                                                   "shapes marked dynamic from the first compile."}),
            "scope": (list(SCOPES), {"default": "auto",
                                     "tooltip": "auto = repeated blocks: identical blocks share one compiled graph. "
                                                "whole model: the diffusion model as one graph, compiled in the "
                                                "prompt's path; a call that another node patches runs eagerly."}),
        }, "optional": {
            "choose": (list(CHOOSE), {"default": "auto", "tooltip": "auto: skip block kinds too small to matter, "
                                      "time compiled against eager per kind, then whole steps; keep the faster. "
                                      "always compiled: compiled blocks from the first call, no timing."}),
            "background": ("BOOLEAN", {"default": True, "tooltip": "choose=auto: a cold compile runs in a child "
                                       "process while the blocks run eagerly; the next steps or prompts pick the "
                                       "compiled blocks up. Off: compile at the first step that needs it."}),
        }, "hidden": OWNER_INPUTS}

    def apply(self, model, mode, dynamic, scope, choose="auto", background=True, unique_id=None, extra_pnginfo=None):
        options = CompileOptions(mode=mode, dynamic=dynamic, scope=scope, choose=choose, background=background)
        log.info("[Accel] Compile Model: %s; compiles lazily at the first sampling step%s", options,
                 " (in the background)" if options.compiles_in_background else "")
        compiled = compile_model(model, options, owner=status_owner(unique_id, extra_pnginfo))
        # recorded once the owner is known, so the node's status shows at once
        telemetry.record("compile_model", "applied", options={"mode": mode, "dynamic": dynamic, "scope": scope,
                                                                "choose": choose, "background": background})
        return (compiled,)


class CompileVAE:
    DISPLAY_NAME = "Compile VAE (Accel)"
    CATEGORY = CATEGORY
    DESCRIPTION = ("torch.compile for the VAE's encoder and decoder. Nothing is compiled when this node runs: a cold "
                   "decode (or encode) runs eagerly while a background process compiles it, and later ones use it, "
                   "kept only where faster than eager.")
    RETURN_TYPES = ("VAE",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "vae": ("VAE", {"tooltip": "The VAE to compile, from a VAE loader or a checkpoint loader; connect the "
                                       "output to VAE Decode (or VAE Encode)."}),
            "mode": (list(MODES), {"default": "default",
                                   "tooltip": "As on Compile Model: default suits most uses; a mode the device "
                                              "lacks compiles as default. low-memory compiles in ComfyUI's own "
                                              "process (the first decode waits for it), no background process."}),
        }, "hidden": OWNER_INPUTS}

    def apply(self, vae, mode, unique_id=None, extra_pnginfo=None):
        compiled = compile_vae(vae, CompileOptions(mode=mode), owner=status_owner(unique_id, extra_pnginfo))
        telemetry.record("compile_vae", "applied", options={"mode": mode})  # after: the node's status names it
        return (compiled,)
