"""Compile Model on every video model family ComfyUI ships: Wan 2.1 and 2.2, HunyuanVideo and LTX-Video (5-D
latents). First the defaults on video as it changes: frames, size and batch, each compiled at most once more and
never in the sampling's path, and the inputs of the graph a child adds for larger batches where a kind was met at
a batch of 1; then each family as test_compile_families.py does for the image families
(tests/family_compile_checks.py), a prompt-length sweep, and the other options (static and dynamic shapes,
whole-model scope) on small DiTs.
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from compile_helpers import assert_close_to_eager, dynamo_frames, own_kinds
from tools.families import BY_FAMILY, TRAINED_WAN, load, sample
from family_compile_checks import SWEEPS, VIDEO_FAMILIES, check_compile_model_on_family, check_sweep



# The frames, size and batch test runs first in this module: at cfg 1 its Wan 2.2 meets the Wan kinds at a batch of
# 1, as a Lightning user's process does, so the batch twin is made (a kind first met at cfg 5 makes none). The
# family tests below it find those kinds compiled, which they allow.
def video_shapes(family) -> list[tuple[int, ...]]:
    """The family's latent, then more frames, then another size, then a larger batch: each change alone."""
    batch, channels, frames, height, width = family.latent_shape
    more_frames = (batch, channels, frames + 2, height, width)
    resized = (batch, channels, frames + 2, height + 8, width + 16)
    return [family.latent_shape, more_frames, resized, (2 * batch, *resized[1:])]


# Wan 2.2 at cfg 1, as its Lightning (step-distilled) LoRAs sample it: one call a step at a batch of 1, as
# HunyuanVideo's guidance-distilled model is sampled (its family's cfg).
WAN22_AT_CFG_1 = dataclasses.replace(BY_FAMILY["wan22"], cfg=1.0)


# make test runs the generated Wan 2.2 (at cfg 1: the batch twin); the trained Wan at cfg 5 and HunyuanVideo run
# in the full tier (tests/conftest.py).
_SWEPT_IN_FULL = pytest.mark.full(why=(
    "the frames, size and batch changes on another video model; make test runs them on Wan 2.2 ([wan22])"))


@pytest.mark.parametrize("family", [pytest.param(TRAINED_WAN, marks=_SWEPT_IN_FULL), WAN22_AT_CFG_1,
                                    pytest.param(BY_FAMILY["hunyuan_video"], marks=_SWEPT_IN_FULL)],
                         ids=lambda f: f.name)
def test_video_frames_size_and_batch_compile_once_off_the_prompt_path(engine, accel_pack, comfy_nodes, family):
    """Compile Model's defaults on a video model (#36): a new frame count, then a new size, then a larger batch each
    run eagerly in their sampling while a child compiles, equal to eager; over the three changes each kind goes to a
    child at most once more (per call variant), and this process never runs Dynamo (the children's graphs load whole).
    Wan 2.2 and HunyuanVideo run at cfg 1, a batch of 1: their larger batch is served by the graph the frame change's
    child made beside the dynamic one (child/batch_twin.py), so no kind sent then is sent again for the batch
    (Wan's rope table stays at a batch of 1 in that graph, as the model keeps it). With DeepCache on top, nothing
    compiles after its first run. On the trained video Wan (bench/deepcache_quality.py --model wan, at cfg 5) and the
    generated Wan 2.2 and HunyuanVideo."""
    name = family.name
    # Kinds this process met before (another test's model of the same block shapes, at cfg 5: a batch of 2) make
    # no twin, by design: their first call, replayed in every job, was not at a batch of 1 (batch_twin.py).
    known = {k["kind"] for k in engine.REGISTRY.stats()["kinds"]}
    model = load(comfy_nodes, family)
    auto = engine.compile_model(model, engine.CompileOptions())
    background = engine.background.BACKGROUND
    frames = dynamo_frames()
    sent_per_change = []  # the kinds each change sent to a child
    for number, shape in enumerate(video_shapes(family)):
        jobs = len(background.stats()["finished"])
        eager = sample(model, family, steps=1, latent_shape=shape)
        assert_close_to_eager(sample(auto, family, steps=1, latent_shape=shape), eager, f"{name} at {shape}")
        assert background.wait(timeout=900), "the background compile did not finish"
        assert_close_to_eager(sample(auto, family, steps=1, latent_shape=shape), eager,
                              f"{name} at {shape}, with the child's graphs")
        if number == 0:  # the first graphs are made (or found in the run's compile cache): the changes start here
            first_jobs = len(background.stats()["finished"])
        sent_per_change.append({kind for job in background.stats()["finished"][jobs:] for kind in job["kinds"]})
    assert dynamo_frames() == frames, f"{name}: this process compiled ({dynamo_frames() - frames} frames)"
    if family.cfg == 1.0:  # the twins of the frame change's graphs served the batch
        assert not (sent_per_change[1] - known) & sent_per_change[3], (name, sent_per_change, known)
    # Each kind went to a child at most once for the three changes, per call variant: one more graph (dynamic), or
    # none where a graph in the compile cache already served (the run's cache is shared between tests).
    changes = background.stats()["finished"][first_jobs:]
    for kind in own_kinds(engine, auto, "auto"):
        sent = sum(kind["kind"] in job["kinds"] for job in changes)
        assert sent <= kind["call_variants"], (name, kind["kind"], sent, kind["call_variants"], changes)
        if kind["path"] == "compiled":
            assert kind["precompiled"]["functions"] >= 1 and kind["precompiled"]["calls"] >= 1, kind

    # DeepCache on top: its first run may need a graph of its own (the outer blocks called through its block
    # patches), off the prompt's path too; the next run compiles nothing anywhere.
    (cached,) = accel_pack.nodes.deepcache.DeepCache().apply(auto, 2, 0, 0.0, 1.0, "uniform")
    shape = video_shapes(family)[-1]
    for run in range(2):
        jobs = len(background.stats()["finished"])
        sample(cached, family, steps=4, latent_shape=shape)
        background.wait(timeout=900)
        assert dynamo_frames() == frames, f"{name} with DeepCache, run {run + 1}: this process compiled"
    assert len(background.stats()["finished"]) == jobs, f"{name} with DeepCache: the second run compiled"


@pytest.mark.parametrize("family", VIDEO_FAMILIES, ids=lambda f: f.name)
def test_compile_model_on_every_video_family(engine, comfy_nodes, family):
    check_compile_model_on_family(engine, comfy_nodes, family)


_SWEPT_IN_FULL_ONLY = {("wan21", "latent_shape"): pytest.mark.full(why=(
    "Wan 2.1's latent sizes under always compiled; make test changes Wan 2.2's frames, size and batch under the "
    "defaults (test_video_frames_size_and_batch_compile_once_off_the_prompt_path[wan22]) and a UNet's latent "
    "width in test_compile_model.py's test_auto_mode_compiles_cold_kinds_in_the_background"))}


@pytest.mark.parametrize("name, sweep", [pytest.param(*case, marks=_SWEPT_IN_FULL_ONLY.get(case, ())) for case in SWEEPS],
                         ids=[f"{n}-{s}" for n, s in SWEEPS])
def test_a_prompt_length_or_size_sweep_compiles_once_per_call_variant_then_never(engine, comfy_nodes, name, sweep):
    check_sweep(engine, comfy_nodes, BY_FAMILY[name], sweep)


# The other options on two small DiT families, each option once (each option makes kinds of its own, so each
# compiles anew; SD3's dynamic graphs alone took 80 s here). Whole-model scope on Wan 2.1 (27 s) is left out for
# CI's time: SD3's and SD1.5's (test_compile_model.py) stay. The shape options run in the full tier.
OPTION_CASES = (("sd3", {"dynamic": "static"}), ("wan21", {"dynamic": "dynamic"}), ("sd3", {"scope": "whole model"}))
_OPTIONS_IN_FULL = {
    "sd3-static": pytest.mark.full(why=(
        "the static option on a DiT; make test compiles SD3's blocks from static graphs under always compiled "
        "(test_compile_families.py[sd3]) and the static option on the UNet (test_compile_cache.py, "
        "test_auto_mode_fair.py)")),
    "wan21-dynamic": pytest.mark.full(why=(
        "the dynamic option on a DiT; make test loads the dynamic graphs the defaults' child made of Wan's blocks "
        "(test_video_frames_size_and_batch_compile_once_off_the_prompt_path[wan22]) and runs the dynamic option "
        "through a child (test_auto_mode_measuring.py)")),
}


def _option_id(name: str, options: dict) -> str:
    return f"{name}-{'-'.join(options.values()).replace(' ', '_')}"


@pytest.mark.parametrize("name, options", [pytest.param(n, o, marks=_OPTIONS_IN_FULL.get(_option_id(n, o), ()))
                                           for n, o in OPTION_CASES],
                         ids=[_option_id(n, o) for n, o in OPTION_CASES])
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


def test_the_batch_twin_repeats_a_batch_of_1_in_the_models_layout(accel_pack, monkeypatch):
    """What the child compiles beside a dynamic graph made at a batch of 1 (child/batch_twin.py): the inputs
    marked on their batch repeated to 2, each with the strides a real batch of 2 has (HunyuanVideo's image tokens
    are a transposed view: another layout would be a graph the model never calls), and so are the tensors inside
    tuples and dataclasses (Chroma's modulation vectors: slices of one table, a batch apart by the whole table),
    marked on their batch; Wan's rope table, which the model keeps at a batch of 1 at every batch, is left as it
    is, by name or position; the rest untouched. Nothing for a first, static graph, a call already at a batch of
    2, a kind whose job also replays a larger batch, or with the switch ACCEL_DISABLE_BATCH_TWIN=1 (and the twin
    again with it at 0)."""
    import comfy.ops
    from comfy.ldm.flux.layers import ModulationOut
    from comfy.ldm.wan.model import WanAttentionBlock

    twin_module = importlib.import_module(accel_pack.__name__ + ".accel.compile.child.batch_twin")
    block = torch.nn.Linear(8, 8)
    tokens = torch.randn(1, 64, 8).transpose(1, 2)  # [1, 8, 64] laid out as HunyuanVideo's img
    table = torch.randn(1, 5)  # not marked on its batch
    dims = {(0, 0), (0, 1), (1, 0)}
    twin_args, twin_kwargs = twin_module.batch_twin(block, (tokens,), {"vec": torch.randn(1, 8), "table": table,
                                                                       "steps": 3}, dims, {1})
    (twin_tokens,) = twin_args
    assert twin_tokens.shape == (2, 8, 64) and twin_tokens.stride() == torch.randn(2, 64, 8).transpose(1, 2).stride()
    assert torch.equal(twin_tokens[0], tokens[0]) and torch.equal(twin_tokens[1], tokens[0])
    assert twin_kwargs["vec"].shape == (2, 8) and twin_kwargs["table"] is table and twin_kwargs["steps"] == 3

    # Chroma's double block: vec=((img shift, scale, gate), (txt ...)), each a [B, 1, D] slice of a [B, 344, D] table
    vectors = torch.randn(1, 344, 8)
    modulation = (ModulationOut(*(vectors[:, i:i + 1] for i in range(3))),
                  ModulationOut(*(vectors[:, i:i + 1] for i in range(3, 6))))
    _, twin_kwargs = twin_module.batch_twin(block, (tokens,), {"vec": (modulation,), "options": {"x": table}},
                                            dims, {1})
    ((img, txt),) = twin_kwargs["vec"]
    real_batch_of_2 = torch.randn(2, 344, 8)[:, 4:5]
    for twin, real in ((img.gate, modulation[0].gate), (txt.shift, modulation[1].shift)):
        assert twin.shape == (2, 1, 8) and twin.stride() == real_batch_of_2.stride(), twin.stride()
        assert torch.equal(twin[0], real[0]) and torch.equal(twin[1], real[0])
        assert 0 in getattr(twin, "_dynamo_weak_dynamic_indices", ()), "a nested batch was not marked"
    assert twin_kwargs["options"]["x"] is table  # a dict (options) is not a batch

    # Wan's block: its rope table stays at a batch of 1, passed by name (as Wan calls it) or by position
    wan = WanAttentionBlock("t2v_cross_attn", 8, 16, 2,
                            operation_settings={"operations": comfy.ops.disable_weight_init})
    x, e, context = torch.randn(1, 8, 8), torch.randn(1, 6, 8), torch.randn(1, 3, 8)
    freqs = torch.randn(1, 8, 1, 2, 2, 2)
    wan_dims = {(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (3, 0)}
    (twin_x,), twin_kwargs = twin_module.batch_twin(wan, (x,), {"e": e, "freqs": freqs, "context": context},
                                                    wan_dims, {1})
    assert twin_x.shape[0] == twin_kwargs["e"].shape[0] == twin_kwargs["context"].shape[0] == 2
    assert twin_kwargs["freqs"] is freqs
    twin_args, _ = twin_module.batch_twin(wan, (x, e, freqs, context), {}, wan_dims, {1})
    assert [t.shape[0] for t in twin_args] == [2, 2, 1, 2] and twin_args[2] is freqs

    assert twin_module.batch_twin(block, (tokens,), {}, {(0, 0)}, {1}) is None  # only the batch marked: a first graph
    assert twin_module.batch_twin(block, (torch.randn(2, 8, 64),), {}, dims, {2}) is None  # a batch of 2 already
    # a kind first met at a batch of 2 (cfg 5, then cfg 1): its dynamic graph for larger batches is not repeated
    assert twin_module.batch_twin(block, (tokens,), {}, dims, {2, 1}) is None
    monkeypatch.setenv(twin_module.SWITCH, "1")
    assert twin_module.SWITCH == "ACCEL_DISABLE_BATCH_TWIN"  # the name README gives users
    assert twin_module.batch_twin(block, (tokens,), {}, dims, {1}) is None
    monkeypatch.setenv(twin_module.SWITCH, "0")
    assert twin_module.batch_twin(block, (tokens,), {}, dims, {1}) is not None
