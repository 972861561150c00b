"""The generated models are real ComfyUI architectures, loaded by ComfyUI's own loader nodes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from compile_helpers import SMALL, SMALL_B


@pytest.fixture(scope="module")
def loaders(comfy_dir):
    import nodes

    return nodes


def test_small_unet_detected_as_sd15(loaders):
    import comfy.supported_models
    import comfy.utils
    import folder_paths

    (model,) = loaders.UNETLoader().load_unet(SMALL, "default")
    assert type(model.model.model_config) is comfy.supported_models.SD15
    unet_config = model.model.model_config.unet_config
    assert unet_config["model_channels"] == 320 and unet_config["context_dim"] == 768
    # The loaded weights are the file's, not ComfyUI's uninitialised memory.
    file_sd = comfy.utils.load_torch_file(folder_paths.get_full_path("diffusion_models", SMALL))
    key = "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    loaded = model.model.diffusion_model.state_dict()[key]
    torch.testing.assert_close(loaded, file_sd["model.diffusion_model." + key].to(loaded.dtype))


def test_second_small_unet_same_architecture_other_weights(loaders):
    (a,) = loaders.UNETLoader().load_unet(SMALL, "default")
    (b,) = loaders.UNETLoader().load_unet(SMALL_B, "default")
    sa, sb = a.model.diffusion_model.state_dict(), b.model.diffusion_model.state_dict()
    assert {k: v.shape for k, v in sa.items()} == {k: v.shape for k, v in sb.items()}
    assert not torch.equal(sa["out.2.weight"], sb["out.2.weight"])


@pytest.mark.parametrize("lora_name", ["accel-sd15-lora.safetensors", "accel-sd15-lora-2.safetensors"])
def test_lora_keys_all_match_small_and_full_sd15(loaders, lora_name):
    import comfy.lora
    import comfy.supported_models
    import comfy.utils
    import folder_paths

    from tools.make_models import SD15_FULL

    lora_sd = comfy.utils.load_torch_file(folder_paths.get_full_path("loras", lora_name))
    (small,) = loaders.UNETLoader().load_unet(SMALL, "default")
    cfg = comfy.supported_models.SD15(dict(SD15_FULL))
    cfg.set_inference_dtype(torch.float32, None)
    full = cfg.get_model({}, device="meta")  # key names and shapes only
    for model in (small.model, full):
        patches = comfy.lora.load_lora(lora_sd, comfy.lora.model_lora_keys_unet(model, {}), log_missing=False)
        assert len(patches) * 3 == len(lora_sd), "every lora_down/lora_up/alpha triple maps to a UNet weight"
        state = model.state_dict()
        for key, patch in patches.items():
            up, down = patch.weights[0], patch.weights[1]
            assert tuple(state[key].shape) == (up.shape[0], down.shape[1])


def test_lora_loader_changes_the_model_output(loaders):
    (model,) = loaders.UNETLoader().load_unet(SMALL, "default")
    (patched, _) = loaders.LoraLoader().load_lora(model, None, "accel-sd15-lora.safetensors", 1.0, 0.0)
    assert len(patched.patches) > 0 and len(model.patches) == 0


def test_clip_l_encodes_a_prompt(loaders):
    (clip,) = loaders.CLIPLoader().load_clip("accel-clip-l.safetensors", "stable_diffusion")
    (cond,) = loaders.CLIPTextEncode().encode(clip, "a photo of a cat")
    tensor = cond[0][0]
    assert tensor.shape == (1, 77, 768) and torch.isfinite(tensor).all()


def test_taesd_listed_and_decodes(loaders):
    assert "taesd" in loaders.VAELoader.vae_list(loaders.VAELoader)
    (vae,) = loaders.VAELoader().load_vae("taesd")
    image = vae.decode(torch.randn(1, 4, 8, 8))
    assert image.shape == (1, 64, 64, 3) and torch.isfinite(image).all()


def test_full_text_to_image_in_process(loaders):
    """UNETLoader → CLIP → KSampler → TAESD decode, all ComfyUI's own nodes, gives a finite image."""
    (model,) = loaders.UNETLoader().load_unet(SMALL, "default")
    (clip,) = loaders.CLIPLoader().load_clip("accel-clip-l.safetensors", "stable_diffusion")
    (pos,) = loaders.CLIPTextEncode().encode(clip, "a lighthouse")
    (neg,) = loaders.CLIPTextEncode().encode(clip, "")
    (latent,) = loaders.EmptyLatentImage().generate(128, 128, 1)
    (samples,) = loaders.KSampler().sample(model, 1, 2, 5.0, "euler", "normal", pos, neg, latent)
    (vae,) = loaders.VAELoader().load_vae("taesd")
    (image,) = loaders.VAEDecode().decode(vae, samples)
    assert image.shape == (1, 128, 128, 3) and torch.isfinite(image).all()


def test_setup_keeps_a_models_file_it_did_not_write(comfy_dir, tmp_path, capsys):
    """With COMFYUI_DIR at a user's own ComfyUI, vae_approx/ holds their real TAESD under the names the tests'
    generated one takes: set-up keeps it (before, it was replaced with random weights, and TAESD previews turned
    to noise), and rewrites only files of its own that are missing or stale."""
    from safetensors.torch import save_file

    from tools.make_models import MODEL_FILES, needs_writing, write_model

    spec = next(f for f in MODEL_FILES if f.name == "taesd_decoder.safetensors")
    theirs = tmp_path / "theirs" / spec.name
    theirs.parent.mkdir()
    save_file({"decoder.layers.0.weight": torch.ones(2)}, str(theirs))  # a real download has no metadata of ours
    assert not needs_writing(theirs, spec) and "kept" in capsys.readouterr().out
    ours = tmp_path / "ours" / spec.name
    assert needs_writing(ours, spec)  # missing
    ours.parent.mkdir()
    write_model(ours, spec)
    assert not needs_writing(ours, spec)  # current
    assert needs_writing(ours, dataclasses.replace(spec, seed=spec.seed + 1))  # ours, for another seed: stale
