"""Compile Model and DeepCache under conditioning that changes the model call (issue #70, item 3): a ControlNet
(a generated one for the small SD1.5 UNet, loaded by ComfyUI's ControlNetLoader, applied by ControlNetApplyAdvanced),
area conditioning (ConditioningSetArea: the UNet is called on a crop of the latent) and mask conditioning
(ConditioningSetMask).

Under Compile Model (always compiled) each output equals eager, every block call ran compiled (the stats' last call
names no eager reason), and a second prompt compiles nothing. Under DeepCache, interval 1 equals the eager output
exactly and interval 3 reuses features on the planned steps with the conditioning still in effect.

Not covered here yet: a DiT ControlNet (Flux's: detection pins 3072 wide, a 2 GB file) and Wan image-to-video
(WanImageToVideo, WanFirstLastFrameToVideo: they need an i2v Wan and a Wan VAE of their own).
"""
from __future__ import annotations

import pytest
import torch

from compile_helpers import SMALL, assert_close_to_eager, conds, deepcache_report, dynamo_frames, last_call
from tools.control_models import write_sd15_controlnet

CONTROLNET = "accel-sd15-small-controlnet.safetensors"
SIZE = 16  # latent pixels; the hint image is 8x that


@pytest.fixture(scope="module")
def unet(comfy_nodes):
    return comfy_nodes.UNETLoader().load_unet(SMALL, "default")[0]


@pytest.fixture(scope="module")
def compiled(engine, unet):
    return engine.compile_model(unet, engine.CompileOptions(choose="always compiled"))


@pytest.fixture(scope="module")
def controlnet(comfy_nodes, tmp_path_factory):
    import folder_paths

    folder = tmp_path_factory.mktemp("controlnet")
    write_sd15_controlnet(folder / CONTROLNET)
    folder_paths.add_model_folder_path("controlnet", str(folder))
    (net,) = comfy_nodes.ControlNetLoader().load_controlnet(CONTROLNET)
    assert type(net).__name__ == "ControlNet", type(net)
    return net


def run(model, positive, negative, steps: int = 3, seed: int = 0):
    import comfy.sample

    latent = torch.zeros(1, 4, SIZE, SIZE)
    return comfy.sample.sample(model, comfy.sample.prepare_noise(latent, seed), steps, 5.0, "euler", "normal",
                               positive, negative, latent, disable_pbar=True, seed=seed)


def controlled(comfy_nodes, controlnet, seed: int = 0):
    positive, negative = conds(seed)
    hint = torch.rand(1, SIZE * 8, SIZE * 8, 3, generator=torch.Generator().manual_seed(3))
    return comfy_nodes.ControlNetApplyAdvanced().apply_controlnet(positive, negative, controlnet, hint, 1.0, 0.0, 1.0)


def area(comfy_nodes, seed: int = 0):
    """The prompt on the whole picture plus a second prompt on its top-left quarter (64x64 pixels)."""
    positive, negative = conds(seed)
    other = [[torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(50 + seed)), {}]]
    (other,) = comfy_nodes.ConditioningSetArea().append(other, 64, 64, 0, 0, 1.0)
    return positive + other, negative


def masked(comfy_nodes, seed: int = 0):
    """A second prompt on a square mask in the middle of the picture."""
    positive, negative = conds(seed)
    other = [[torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(60 + seed)), {}]]
    mask = torch.zeros(1, SIZE * 8, SIZE * 8)
    mask[:, 32:96, 32:96] = 1.0
    (other,) = comfy_nodes.ConditioningSetMask().append(other, mask, "default", 1.0)
    return positive + other, negative


CASES = {"controlnet": controlled, "area": area, "mask": masked}


def make(case: str, comfy_nodes, controlnet, seed: int = 0):
    return CASES[case](comfy_nodes, controlnet, seed) if case == "controlnet" else CASES[case](comfy_nodes, seed)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_equals_eager_runs_every_block_compiled_and_a_second_prompt_compiles_nothing(
        engine, comfy_nodes, unet, compiled, controlnet, case):
    positive, negative = make(case, comfy_nodes, controlnet)
    eager = run(unet, positive, negative)
    assert not torch.allclose(eager, run(unet, *conds(0))), f"{case}: the conditioning changed nothing"
    assert_close_to_eager(run(compiled, positive, negative), eager, f"{case}: always compiled")
    last = last_call(engine, compiled)
    assert last["blocks"] and last["compiled"] == last["blocks"] and not last["eager"], last
    frames = dynamo_frames()
    positive, negative = make(case, comfy_nodes, controlnet, seed=1)  # the next prompt: other values, same shapes
    assert_close_to_eager(run(compiled, positive, negative), run(unet, positive, negative), f"{case}: next prompt")
    assert dynamo_frames() == frames, f"{case}: the second prompt compiled"


def deepcache(accel_pack, model, interval: int):
    return accel_pack.nodes.deepcache.DeepCache().apply(model, interval, 1, 0.0, 1.0, "uniform")[0]


@pytest.mark.parametrize("case", list(CASES))
def test_deepcache_equals_eager_at_interval_1_and_reuses_at_3(accel_pack, comfy_nodes, unet, controlnet, case):
    positive, negative = make(case, comfy_nodes, controlnet)
    assert torch.equal(run(deepcache(accel_pack, unet, 1), positive, negative), run(unet, positive, negative)), case
    out = run(deepcache(accel_pack, unet, 3), positive, negative, steps=6)
    report = deepcache_report(accel_pack)
    assert report["status"] == "completed" and report["reused_steps"] == 4, report
    plain = run(deepcache(accel_pack, unet, 3), *conds(0), steps=6)
    assert torch.isfinite(out).all() and not torch.allclose(out, plain), f"{case}: lost under DeepCache"
