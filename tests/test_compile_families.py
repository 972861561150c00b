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


@pytest.mark.full(why=(
    "Lumina 2's rope strides at a new size; make test compiles Lumina 2 in "
    "test_compile_model_on_every_image_family[lumina2] and changes the size on Wan 2.2"))
def test_a_size_change_on_lumina2_compiles_nothing(engine, comfy_nodes, monkeypatch, tmp_path):
    """Lumina 2 (and Z-Image, its family) gives its context refiner the first caption-length rows of a rope table
    as long as caption and image together: at another image size that input keeps its shape and contiguity, and
    the strides of its batch and head dimensions (both of size 1) change, which Dynamo guards. With the defaults at
    cfg 1 (one call at a batch of 1) the compiled call gets those strides steady (shapes.steady_unit_strides), so
    the size change needs no graph: no job, no Dynamo frame in this process, equal to eager. (Before, the new
    strides went to a child under the first call's signature, and the prompt after the child compiled the refiner
    here.) Then a batch change runs eagerly while a child compiles it, and compiles nothing here either; at a
    batch of 2 the refiner's slice has a real stride that follows the image size, and the child's graph, made from
    the first call's and the new one, takes it as dynamic: one more size at a batch of 2 needs no job. On a
    compile cache of its own, and first in this file: "no job" holds where the test meets the kinds first (its
    process's kinds of one architecture are shared; after the family test's prompts at cfg 4, a batch of 2, the
    cfg-1 prompts here are new shapes of kinds already compiled, whose jobs make other graphs), and is asserted
    only then."""
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))
    family = BY_FAMILY["lumina2"]
    fresh = not [k for k in engine.REGISTRY.stats()["kinds"] if k["kind"].startswith("JointTransformerBlock[2304")]
    model = load(comfy_nodes, family)
    auto = engine.compile_model(model, engine.CompileOptions())
    background = engine.background.BACKGROUND
    shape = family.latent_shape
    resized = (*shape[:-2], shape[-2] + 8, shape[-1] + 8)
    batch_2_resized_again = (2 * shape[0], *shape[1:-2], shape[-2] + 16, shape[-1] + 8)
    frames = dynamo_frames()
    for latent_shape in (shape, resized, (2 * shape[0], *resized[1:]), batch_2_resized_again):
        eager = sample(model, family, steps=1, cfg=1.0, latent_shape=latent_shape)
        jobs = len(background.stats()["finished"])
        for run in ("first", "after the child"):
            out = sample(auto, family, steps=1, cfg=1.0, latent_shape=latent_shape)
            assert_close_to_eager(out, eager, f"lumina2 at {latent_shape}, {run}")
            assert dynamo_frames() == frames, f"lumina2 at {latent_shape}, {run}: this process compiled"
            assert background.wait(timeout=900), "the background compile did not finish"
        # "no job" where the kinds are first met here (run alone, or first in its process)
        if latent_shape in (resized, batch_2_resized_again) and fresh:
            assert len(background.stats()["finished"]) == jobs, \
                f"the size change at {latent_shape} needed graphs: {background.stats()}"


# Chroma (Flux's blocks, its own modulation) and SDXL run in the full tier (tests/conftest.py)
_IN_FULL = {
    "chroma": pytest.mark.full(why=(
        "Chroma compiled; make test compiles Flux's double and single blocks in test_compile_flux.py and finds "
        "Chroma's in test_family_structure.py's test_family_blocks_are_found[chroma]")),
    "sdxl": pytest.mark.full(why=(
        "SDXL compiled in process; make test compiles SDXL's stand-in under Compile Model over HTTP in "
        "test_templates.py's test_each_template_runs_to_its_output[sdxl_swap_base_and_turbo] and the SD1.5 UNet's "
        "blocks (SDXL's kinds) in test_compile_model.py"))}


@pytest.mark.parametrize("family", [pytest.param(f, marks=_IN_FULL.get(f.name, ())) for f in IMAGE_FAMILIES],
                         ids=lambda f: f.name)
def test_compile_model_on_every_image_family(engine, comfy_nodes, family):
    check_compile_model_on_family(engine, comfy_nodes, family)


def test_a_calls_signature_tells_apart_the_strides_dynamo_guards(engine):
    """Slices of tables of two lengths, of one shape and contiguity, as Lumina 2's refiner gets at two image sizes:
    Dynamo compiles each (its own frame counter), so their signatures differ and a child's graph for the second
    gets a name of its own (at a batch of 2, where the stride that changes is a size-2 dimension's). Where only
    size-1 dimensions' strides differ (a batch of 1), the steady view of each is the same elements and one graph."""
    import torch
    from torch._dynamo.testing import CompileCounter

    shapes = engine.shapes

    def frames(function, inputs) -> int:  # each case its own function: Dynamo keeps its graphs per code object
        counter = CompileCounter()
        compiled = torch.compile(function, backend=counter, dynamic=False)
        for x in inputs:
            compiled(x)
        return counter.frame_count

    at_2 = torch.randn(2, 100, 8)[:, :10], torch.randn(2, 200, 8)[:, :10]
    at_1 = torch.randn(1, 100, 8)[:, :10], torch.randn(1, 200, 8)[:, :10]
    for pair in (at_2, at_1):
        assert pair[0].shape == pair[1].shape and pair[0].is_contiguous() == pair[1].is_contiguous()
        assert shapes.input_signature((pair[0],), {}) != shapes.input_signature((pair[1],), {})
    assert frames(lambda x: x * 2, at_2) == 2 and frames(lambda x: x * 3, at_1) == 2, "one graph served both"
    steady = [shapes.steady_unit_strides((x,), {})[0][0] for x in at_1]
    assert all(torch.equal(s, x) and s.data_ptr() == x.data_ptr() for s, x in zip(steady, at_1))
    assert shapes.input_signature((steady[0],), {}) == shapes.input_signature((steady[1],), {})
    assert frames(lambda x: x * 4, steady) == 1, "the steady views still needed two graphs"
