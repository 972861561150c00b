"""Compile Model on every model family ComfyUI ships: SDXL, SD3, Flux, Chroma, Wan 2.1 and 2.2 (5-D video
latents), HunyuanVideo, Qwen-Image, Lumina 2 and LTX-Video, each a generated model (tools/family_models.py)
loaded by ComfyUI's own UNETLoader and sampled by its own sampler with conditioning tensors of the family's
widths (tests/families.py).

With every default (choose=auto, background compile) and with choose=always compiled, the output equals eager
within the compiled tolerance, the background child's graphs are loaded, the repeat compiles nothing, and a
prompt-length sweep and a size sweep each cost at most one compile per kind and call variant, then none (on four
families in CI). Other options (static and dynamic shapes, whole-model scope) on two small DiTs. Compiles are
counted with Dynamo's own counter, as a change over what each step does.
"""
from __future__ import annotations

import os

import pytest

from compile_helpers import assert_close_to_eager, dynamo_frames, own_kinds
from families import FAMILIES, load, sample


# The sweeps compile dynamic graphs (20-45 s each here): CI runs them on one model of each shape of model (a
# DiT with double and single blocks, a video DiT, a video DiT with a token refiner, a UNet); ACCEL_ALL_SWEEPS=1
# on every family.
SWEEP_FAMILIES = {"flux", "wan21", "sdxl", "hunyuan_video"}
# Measured exceptions to "one compile per kind and call variant": HunyuanVideo's token refiner compiles its
# dynamic graph twice on the first longer prompt (the second after a guard on an input that is None).
EXTRA_SWEEP_COMPILES = {("hunyuan_video", "tokens"): 1}


@pytest.fixture(scope="module")
def engine(accel_pack):
    return accel_pack.accel.compile


def sweep(model, family, **changes) -> int:
    """Dynamo frames compiled over one sampling per value of one input (a prompt length, a latent size)."""
    (name, values), = changes.items()
    frames = dynamo_frames()
    for value in values:
        sample(model, family, steps=1, **{name: value})
    return dynamo_frames() - frames


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_compile_model_on_every_family(engine, comfy_nodes, family):
    model = load(comfy_nodes, family)
    eager = sample(model, family)

    # Every default: choose=auto, cold kinds compiled by a child process while the blocks run eagerly.
    auto = engine.compile_model(model, engine.CompileOptions())
    assert_close_to_eager(sample(auto, family), eager, f"{family.name}: defaults, first sampling")
    assert engine.background.BACKGROUND.wait(timeout=900), "the background compile did not finish"
    assert_close_to_eager(sample(auto, family), eager, f"{family.name}: defaults, with the child's graphs")
    kinds = own_kinds(engine, auto, "auto")
    assert kinds, "Compile Model found no blocks to compile"
    labels = [k["kind"] for k in kinds]
    assert len(set(labels)) == len(labels), f"two kinds share a label: {labels}"
    assert not [k for k in kinds if k["background"]["state"] == "failed"], kinds

    # choose=always compiled: compiled from the first call (the same graphs: choose is not part of the key).
    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    assert_close_to_eager(sample(always, family), eager, f"{family.name}: always compiled")
    always_kinds = own_kinds(engine, always, "always compiled")
    assert all(k["compiles"] >= 1 for k in always_kinds), always_kinds
    frames = dynamo_frames()
    assert_close_to_eager(sample(always, family), eager, f"{family.name}: always compiled, repeat")
    assert_close_to_eager(sample(auto, family), eager, f"{family.name}: defaults, repeat")
    assert dynamo_frames() == frames, "the repeat compiled again"

    # Prompt length (77, 154, 231 tokens) and latent size: at most one more compile per kind and call variant
    # each, then none. (A variant is a way the model calls a kind apart from sizes: Wan's first block gets its
    # input transposed, the others do not; HunyuanVideo's token refiner is called with and without a mask.)
    if family.name not in SWEEP_FAMILIES and not os.environ.get("ACCEL_ALL_SWEEPS"):
        return
    graphs = sum(k["call_variants"] for k in always_kinds)
    tokens = [family.tokens, 2 * family.tokens, 3 * family.tokens]
    shape = family.latent_shape
    sizes = [shape, (*shape[:-2], shape[-2] + 8, shape[-1] + 8), (*shape[:-2], shape[-2] + 8, shape[-1] + 16)]
    for name, values in (("tokens", tokens), ("latent_shape", sizes)):
        first = sweep(always, family, **{name: values})
        allowed = graphs + EXTRA_SWEEP_COMPILES.get((family.name, name), 0)
        assert first <= allowed, f"{family.name}: the {name} sweep compiled {first} times for {graphs} call variants"
        assert sweep(always, family, **{name: values}) == 0, f"{family.name}: the repeated {name} sweep compiled"
    out = sample(always, family, tokens=tokens[-1], latent_shape=sizes[-1])
    assert_close_to_eager(out, sample(model, family, tokens=tokens[-1], latent_shape=sizes[-1]),
                          f"{family.name}: after the sweeps")


# The other options on two small DiT families (each option makes kinds of its own, so each compiles anew).
OPTION_FAMILIES = ("sd3", "wan21")
OTHER_OPTIONS = ({"dynamic": "static"}, {"dynamic": "dynamic"}, {"scope": "whole model"})


@pytest.mark.parametrize("options", OTHER_OPTIONS, ids=lambda o: "-".join(o.values()).replace(" ", "_"))
@pytest.mark.parametrize("name", OPTION_FAMILIES)
def test_compile_model_options_on_dit_families(engine, comfy_nodes, name, options):
    family = next(f for f in FAMILIES if f.name == name)
    model = load(comfy_nodes, family)
    eager = sample(model, family)
    compiled = engine.compile_model(model, engine.CompileOptions(choose="always compiled", **options))
    frames = dynamo_frames()
    assert_close_to_eager(sample(compiled, family), eager, f"{name} with {options}")
    assert dynamo_frames() > frames, f"{name} with {options} compiled nothing"
    frames = dynamo_frames()
    assert_close_to_eager(sample(compiled, family), eager, f"{name} with {options}, repeat")
    assert dynamo_frames() == frames, f"{name} with {options}: the repeat compiled again"
