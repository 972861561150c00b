"""Compile Model on every image model family ComfyUI ships: SDXL, SD3, Chroma, Qwen-Image and Lumina 2, each a
generated model (tools/family_models.py) loaded by ComfyUI's own UNETLoader (detected as the family's model
class) and sampled by its own sampler with conditioning tensors of the family's widths (tools/families.py).
What is checked per family: tests/family_compile_checks.py. The video families and the other options are in
test_compile_video_families.py; Flux's checks are in test_compile_flux.py (always compiled) and
test_server_families.py (the defaults, through a started server).
"""
from __future__ import annotations

import pytest

from compile_helpers import assert_close_to_eager, dynamo_frames
from family_compile_checks import IMAGE_FAMILIES, check_compile_model_on_family
from tools.families import BY_FAMILY, load, sample


@pytest.mark.parametrize("family", IMAGE_FAMILIES, ids=lambda f: f.name)
def test_compile_model_on_every_image_family(engine, comfy_nodes, family):
    check_compile_model_on_family(engine, comfy_nodes, family)


def test_a_size_change_on_lumina2_compiles_nothing_in_the_prompt(engine, comfy_nodes):
    """Lumina 2 (and Z-Image, its family) gives its context refiner a slice of a rope table as long as the caption
    and the image together: at another image size that input keeps its shape and contiguity and changes a stride,
    which Dynamo guards. With the defaults, the new size runs eagerly while a child compiles it, and once the child
    is done the same prompt runs from the child's graphs, equal to eager, with no Dynamo frame in this process (the
    second prompt compiled the refiner here before the calls' signatures held strides). Then a batch change, the
    same. At cfg 1 (one call at a batch of 1), where the table's batch dimension is a size 1."""
    family = BY_FAMILY["lumina2"]
    model = load(comfy_nodes, family)
    auto = engine.compile_model(model, engine.CompileOptions())
    background = engine.background.BACKGROUND
    shape = family.latent_shape
    resized = (*shape[:-2], shape[-2] + 8, shape[-1] + 8)
    frames = dynamo_frames()
    for latent_shape in (shape, resized, (2 * shape[0], *resized[1:])):
        eager = sample(model, family, steps=1, cfg=1.0, latent_shape=latent_shape)
        for run in ("first", "after the child"):
            out = sample(auto, family, steps=1, cfg=1.0, latent_shape=latent_shape)
            assert_close_to_eager(out, eager, f"lumina2 at {latent_shape}, {run}")
            assert dynamo_frames() == frames, f"lumina2 at {latent_shape}, {run}: this process compiled"
            assert background.wait(timeout=900), "the background compile did not finish"
