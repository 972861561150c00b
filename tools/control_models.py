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


# SD3's ControlNets ship in diffusers' key format (`transformer_blocks.N.attn.to_q`, `pos_embed.proj`), which
# comfy.controlnet.load_controlnet_mmdit converts with comfy.utils.mmdit_to_diffusers's map and then detects like
# the model: the width follows from the weights (64 per block of the model's depth), so the net of the generated
# SD3 (tools/family_models.py, depth 2, hidden 128) is as small as that model. Flux's ControlNets are detected at
# full width (3072), a 2 GB file: SD3's is the DiT ControlNet the tests generate.
SD3_CONTROLNET_BLOCKS = 1  # SD3 ControlNets have fewer blocks than the model (each output feeds depth/blocks)


def sd3_controlnet_state_dict(seed: int, blocks: int = SD3_CONTROLNET_BLOCKS) -> dict:
    import torch
    import comfy.cldm.mmdit
    import comfy.ops
    import comfy.utils

    from tools.family_models import BY_NAME, fill_family

    config = dict(BY_NAME["sd3"].unet_config)
    depth = config["depth"]
    net = comfy.cldm.mmdit.ControlNet(num_blocks=blocks, control_latent_channels=config["in_channels"],
                                      operations=comfy.ops.disable_weight_init, device="meta", dtype=torch.float32,
                                      **config)
    comfy_sd = fill_family(net, seed)
    for key, tensor in comfy_sd.items():
        if key.startswith("controlnet_blocks."):  # the residuals, kept small as a trained net's zero-init ones
            comfy_sd[key] = tensor * ZERO_CONV_SCALE
    out, taken = {}, set()
    # The map goes diffusers -> ComfyUI, with fused q/k/v taken as slices and a scale/shift swap (an involution).
    for diffusers_key, target in comfy.utils.mmdit_to_diffusers({"depth": depth, "num_blocks": blocks}).items():
        name, offset, fun = (target, None, None) if isinstance(target, str) else (target[0], target[1],
                                                                                  target[2] if len(target) > 2 else None)
        if name not in comfy_sd:
            continue  # the model's keys a ControlNet lacks (final layer, later blocks)
        tensor = comfy_sd[name] if offset is None else comfy_sd[name].narrow(*offset)
        out[diffusers_key] = (fun(tensor) if fun is not None else tensor).contiguous()
        taken.add(name)
    # Keys of the ControlNet's own (controlnet_blocks, pos_embed_input) are the same in both formats.
    out.update({k: v.contiguous() for k, v in comfy_sd.items() if k not in taken})
    return out


def write_sd3_controlnet(path, seed: int = 11):
    import safetensors.torch

    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(sd3_controlnet_state_dict(seed), str(path))
    return path
