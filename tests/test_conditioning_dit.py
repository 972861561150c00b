"""Compile Model and DeepCache under conditioning that changes a transformer's call (issue #70, items 3 and 4), as
test_conditioning.py does on the SD1.5 UNet:

- Wan 2.1 image-to-video (WanImageToVideo: a start image through the Wan VAE into a concat latent, and a CLIP
  vision output into the image-attention tokens) and first-last-frame (WanFirstLastFrameToVideo, on a model with
  the first-last-frame position embedding: two images, 514 image tokens). The models are generated here as
  Wan 2.1 I2V and FLF2V files (the Wan 2.1 family's config with 36 input channels and the image projection),
  detected by ComfyUI's own loader; the CLIP vision outputs are fed as tensors.
- An SD3 ControlNet (diffusers' format, detected and converted by ComfyUI's ControlNetLoader; the hint image
  goes through a 16-channel VAE, as ControlNetApplyAdvanced does for latent ControlNets). Flux's ControlNets
  work the same way (residuals added after each block) but detect at full width: tools/control_models.py.

Under Compile Model (always compiled) outputs equal eager, every block call ran compiled, and a second prompt
with other values compiles nothing. Under DeepCache, interval 1 equals eager exactly; at interval 3 the Wan runs
reuse on the planned steps; with the ControlNet every call runs in full (its residuals land inside the skipped
blocks), the output equals eager exactly, and the run's report and the node's status say why.
"""
from __future__ import annotations

import pytest
import torch

from compile_helpers import assert_close_to_eager, deepcache_report, dynamo_frames, last_call
from tools.control_models import write_sd3_controlnet
from tools.families import BY_FAMILY

WAN = BY_FAMILY["wan21"]
SD3 = BY_FAMILY["sd3"]
WIDTH = HEIGHT = 128  # pixels: 16x16 latent pixels, as the families' small latents
LENGTH = 5  # frames: 2 latent frames
CLIP_VISION_WIDTH, CLIP_VISION_TOKENS = 1280, 257  # CLIP-H's penultimate hidden states, as Wan's image projection reads


def write_wan_i2v(folder, name: str, first_last: bool, seed: int):
    """A Wan 2.1 I2V (or FLF2V) file of the test family's width, detected back by ComfyUI as WAN21_I2V."""
    import safetensors.torch

    from tools.family_models import BY_NAME, Family, family_state_dict

    config = dict(BY_NAME["wan21"].unet_config, model_type="i2v", in_dim=36)
    if first_last:
        config["flf_pos_embed_token_number"] = 2 * CLIP_VISION_TOKENS
    family = Family(name, "WAN21_I2V", config)
    safetensors.torch.save_file(family_state_dict(family, seed), str(folder / family.file_name))
    return family.file_name


def write_vae(folder, kind: str, seed: int) -> str:
    import safetensors.torch

    from tools.make_models import vae_state_dict

    name = f"accel-test-{kind}-vae.safetensors"
    safetensors.torch.save_file(vae_state_dict(kind, seed), str(folder / name))
    return name


@pytest.fixture(scope="module")
def files(comfy_dir, tmp_path_factory):
    """The generated files, in ComfyUI's model folders as extra_model_paths would add them."""
    import folder_paths

    root = tmp_path_factory.mktemp("dit-conditioning")
    for sub in ("diffusion_models", "vae", "controlnet"):
        (root / sub).mkdir()
        folder_paths.add_model_folder_path(sub, str(root / sub))
    write_sd3_controlnet(root / "controlnet" / "accel-sd3-small-controlnet.safetensors")
    return {"i2v": write_wan_i2v(root / "diffusion_models", "wan21-i2v", False, seed=31),
            "flf2v": write_wan_i2v(root / "diffusion_models", "wan21-flf2v", True, seed=32),
            "wan_vae": write_vae(root / "vae", "wan21", seed=33), "vae16": write_vae(root / "vae", "flux", seed=34),
            "controlnet": "accel-sd3-small-controlnet.safetensors"}


def images(count: int, seed: int):
    return [torch.rand(1, HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(seed + i)) for i in range(count)]


def clip_vision(seed: int):
    import comfy.clip_vision

    out = comfy.clip_vision.Output()
    out["penultimate_hidden_states"] = torch.randn(1, CLIP_VISION_TOKENS, CLIP_VISION_WIDTH,
                                                   generator=torch.Generator().manual_seed(seed))
    return out


def wan_image_to_video(comfy_nodes, files, seed: int):
    from comfy_extras.nodes_wan import WanImageToVideo

    (vae,) = comfy_nodes.VAELoader().load_vae(files["wan_vae"])
    positive, negative = WAN.conds(seed)
    (start,) = images(1, 100 + seed)
    positive, negative, latent = WanImageToVideo.execute(positive, negative, vae, WIDTH, HEIGHT, LENGTH, 1,
                                                         start_image=start,
                                                         clip_vision_output=clip_vision(200 + seed)).result
    return positive, negative, latent["samples"]


def wan_first_last_frame(comfy_nodes, files, seed: int):
    from comfy_extras.nodes_wan import WanFirstLastFrameToVideo

    (vae,) = comfy_nodes.VAELoader().load_vae(files["wan_vae"])
    positive, negative = WAN.conds(seed)
    start, end = images(2, 100 + seed)
    positive, negative, latent = WanFirstLastFrameToVideo.execute(
        positive, negative, vae, WIDTH, HEIGHT, LENGTH, 1, start_image=start, end_image=end,
        clip_vision_start_image=clip_vision(200 + seed), clip_vision_end_image=clip_vision(300 + seed)).result
    return positive, negative, latent["samples"]


def sd3_controlnet(comfy_nodes, files, seed: int):
    (net,) = comfy_nodes.ControlNetLoader().load_controlnet(files["controlnet"])
    (vae,) = comfy_nodes.VAELoader().load_vae(files["vae16"])
    positive, negative = SD3.conds(seed)
    (hint,) = images(1, 100 + seed)
    positive, negative = comfy_nodes.ControlNetApplyAdvanced().apply_controlnet(positive, negative, net, hint,
                                                                                1.0, 0.0, 1.0, vae=vae)
    return positive, negative, torch.zeros(SD3.latent_shape)


# case: (the model's file key or the family's own file, the conditioning, the family's sampling settings)
CASES = {
    "wan_i2v": ("i2v", wan_image_to_video, WAN),
    "wan_first_last_frame": ("flf2v", wan_first_last_frame, WAN),
    "sd3_controlnet": (None, sd3_controlnet, SD3),
}


@pytest.fixture(scope="module")
def models(comfy_nodes, files):
    loaded = {}
    for case, (key, _, family) in CASES.items():
        name = files[key] if key else family.file_name
        (loaded[case],) = comfy_nodes.UNETLoader().load_unet(name, "default")
    assert type(loaded["wan_i2v"].model).__name__ == "WAN21" and loaded["wan_i2v"].model.image_to_video
    return loaded


def run(model, family, positive, negative, latent, steps: int = 3, seed: int = 0):
    import comfy.sample

    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, steps, family.cfg, "euler", "normal", positive, negative, latent,
                               disable_pbar=True, seed=seed)


# First-last-frame compiles the I2V blocks again for its 514 image tokens: make test compiles them for
# image-to-video and runs first-last-frame under DeepCache.
_COMPILED_IN_FULL = {"wan_first_last_frame": pytest.mark.full(why=(
    "the Wan I2V blocks compiled again for first-last-frame's 514 image tokens; make test compiles them for "
    "image-to-video (the wan_i2v case) and runs first-last-frame under DeepCache"))}


@pytest.mark.parametrize("case", [pytest.param(c, marks=_COMPILED_IN_FULL.get(c, ())) for c in CASES])
def test_compiled_equals_eager_runs_every_block_compiled_and_a_second_prompt_compiles_nothing(
        engine, comfy_nodes, files, models, case):
    _, make, family = CASES[case]
    model = models[case]
    positive, negative, latent = make(comfy_nodes, files, 0)
    eager = run(model, family, positive, negative, latent)
    plain = run(model, family, *family.conds(0), latent)
    assert not torch.allclose(eager, plain), f"{case}: the conditioning changed nothing"
    compiled = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    assert_close_to_eager(run(compiled, family, positive, negative, latent), eager, f"{case}: always compiled")
    last = last_call(engine, compiled)
    assert last["blocks"] and last["compiled"] == last["blocks"] and not last["eager"], last
    frames = dynamo_frames()
    positive, negative, latent = make(comfy_nodes, files, 1)  # the next prompt: other images and text, same shapes
    assert_close_to_eager(run(compiled, family, positive, negative, latent),
                          run(model, family, positive, negative, latent), f"{case}: next prompt")
    assert dynamo_frames() == frames, f"{case}: the second prompt compiled"


def deepcache(accel_pack, model, interval: int):
    # cache depth 0 and "first only": the generated SD3 and Wan have 2 blocks, and only the first one runs on a
    # reused step (any more live blocks would leave no block to skip).
    return accel_pack.nodes.deepcache.DeepCache().apply(model, interval, 0, 0.0, 1.0, "uniform",
                                                        live_blocks="first only")[0]


@pytest.mark.parametrize("case", list(CASES))
def test_deepcache_equals_eager_at_interval_1_and_at_3_reuses_or_says_why_not(
        accel_pack, comfy_nodes, files, models, case):
    _, make, family = CASES[case]
    model = models[case]
    positive, negative, latent = make(comfy_nodes, files, 0)
    assert torch.equal(run(deepcache(accel_pack, model, 1), family, positive, negative, latent),
                       run(model, family, positive, negative, latent)), case
    out = run(deepcache(accel_pack, model, 3), family, positive, negative, latent, steps=6)
    report = deepcache_report(accel_pack)
    assert report["status"] == "completed", report
    if case == "sd3_controlnet":
        assert report["reused_steps"] == 0 and report["shallow_calls"] == 0, report
        assert torch.equal(out, run(model, family, positive, negative, latent, steps=6)), "a full run changed"
        (reason, calls), = report["ran_full"].items()
        assert "ControlNet" in reason and calls == 4, report  # the 4 planned reused steps, one call each at cfg
        text = accel_pack.nodes.status.deepcache_run_text(report)  # the node's status line in the web UI
        assert "ControlNet" in text and "in full" in text, text
    else:
        assert report["reused_steps"] == 4 and not report["ran_full"], report
        plain = run(deepcache(accel_pack, model, 3), family, *family.conds(0), latent, steps=6)
        assert torch.isfinite(out).all() and not torch.allclose(out, plain), f"{case}: lost under DeepCache"
