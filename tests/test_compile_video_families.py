"""Compile Model on every video model family ComfyUI ships: Wan 2.1 and 2.2, HunyuanVideo and LTX-Video (5-D
latents), as test_compile_families.py does for the image families (tests/family_compile_checks.py); then the
other options (static and dynamic shapes, whole-model scope) on small DiTs.
"""
from __future__ import annotations

import pytest

from compile_helpers import assert_close_to_eager, dynamo_frames
from families import BY_FAMILY, load, sample
from family_compile_checks import VIDEO_FAMILIES, check_compile_model_on_family



@pytest.mark.parametrize("family", VIDEO_FAMILIES, ids=lambda f: f.name)
def test_compile_model_on_every_video_family(engine, comfy_nodes, family):
    check_compile_model_on_family(engine, comfy_nodes, family)


# The other options on two small DiT families, each option once (each option makes kinds of its own, so each
# compiles anew; SD3's dynamic graphs alone took 80 s here). Whole-model scope on Wan 2.1 (27 s) is left out for
# CI's time: SD3's and SD1.5's (test_compile_model.py) stay.
OPTION_CASES = (("sd3", {"dynamic": "static"}), ("wan21", {"dynamic": "dynamic"}), ("sd3", {"scope": "whole model"}))


@pytest.mark.parametrize("name, options", OPTION_CASES,
                         ids=[f"{n}-{'-'.join(o.values()).replace(' ', '_')}" for n, o in OPTION_CASES])
def test_compile_model_options_on_dit_families(engine, comfy_nodes, name, options):
    family = BY_FAMILY[name]
    model = load(comfy_nodes, family)
    eager = sample(model, family)
    compiled = engine.compile_model(model, engine.CompileOptions(choose="always compiled", **options))
    frames = dynamo_frames()
    assert_close_to_eager(sample(compiled, family), eager, f"{name} with {options}")
    assert dynamo_frames() > frames, f"{name} with {options} compiled nothing"
    frames = dynamo_frames()
    assert_close_to_eager(sample(compiled, family), eager, f"{name} with {options}, repeat")
    assert dynamo_frames() == frames, f"{name} with {options}: the repeat compiled again"
