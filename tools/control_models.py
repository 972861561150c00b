"""A generated ControlNet for the small SD1.5 UNet, in the format ComfyUI's ControlNetLoader detects.

The original ControlNet checkpoint layout (`control_model.` keys, `control_model.zero_convs.0.0.weight` is what
comfy.controlnet.load_controlnet_state_dict looks for): ComfyUI reads the UNet config back from the ControlNet's own
input and middle blocks (model_detection.model_config_from_unet) and builds comfy.cldm.cldm.ControlNet from it, so
the net is built here from the small UNet's config (tools/make_models.SD15_SMALL) and a 3-channel hint.

A trained ControlNet's zero convolutions start at zero; these are random (fill_family, then scaled down) so that
the control changes the picture, by an amount that keeps the latent finite over a few steps.
"""
from __future__ import annotations

PREFIX = "control_model."
ZERO_CONV_SCALE = 0.2  # the residuals' size relative to an initialised layer's


def sd15_controlnet_state_dict(seed: int) -> dict:
    import torch
    import comfy.cldm.cldm
    import comfy.ops

    from tools.family_models import fill_family
    from tools.make_models import SD15_SMALL

    config = {k: v for k, v in SD15_SMALL.items() if k != "out_channels"}
    net = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init, device="meta",
                                     dtype=torch.float32, **config)
    state_dict = fill_family(net, seed)
    for key, tensor in state_dict.items():
        if key.startswith(("zero_convs.", "middle_block_out.")):
            state_dict[key] = tensor * ZERO_CONV_SCALE
    return {PREFIX + k: v.contiguous() for k, v in state_dict.items()}


def write_sd15_controlnet(path, seed: int = 7):
    import safetensors.torch

    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(sd15_controlnet_state_dict(seed), str(path))
    return path
