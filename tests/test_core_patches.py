"""Every core model patch under the pack (issue #70, items 1 and 4).

Through a started server: every core node that takes a MODEL and returns a MODEL, found from `/object_info` (a node
a new ComfyUI adds is covered without editing this file), runs with its default inputs on the SD1.5 UNet without
the pack, always compiled and under DeepCache at interval 1 (and with Compile Model's defaults for a few; in
`make test` a subset of the nodes, CI_NODES, every other one checked against the matrix's last result):
compiled and DeepCache outputs equal the same patch without the pack within compiled rounding, a patch that changes
the output at its defaults still changes it under the pack, and a patch that changes only the sampling around the
model keeps every block call compiled (counted by each Compile Model node's own status). tools/patch_matrix.py
runs the cases; `python -m tools.patch_matrix` runs the whole matrix (more families) and
`ACCEL_PATCH_MATRIX=all` runs it here. docs/compatibility.md is written from its results.

In-process: another node's patch the pack does not know, an attention replacement and a block's forward set by
another node pass through eagerly, the output as without the pack, with one line naming the node and the reason
and a count in the stats.
"""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from compile_helpers import assert_close_to_eager, load, sample
from tools import patch_matrix
from tools.comfy_env import comfyui_version
from tools.comfy_server import ComfyServer
from tools.soak_prompts import TEST_NODES

FULL = os.environ.get("ACCEL_PATCH_MATRIX") == "all"
FAMILIES = ("sd15", "sdxl", "flux", "wan21") if FULL else ("sd15",)
# In `make test` (two ComfyUI versions, at most 18 minutes each) a subset runs every way: a node of each kind of
# patch (the sampling object, CFG-style guidance, the denoise mask, attention and UNet patches, token merging,
# LoRA, a merge). Every other node found is checked against the matrix's last committed result for this ComfyUI
# (docs/patch_matrix/<version>.json, written by `python -m tools.patch_matrix`): a node a new ComfyUI adds fails
# until the matrix has run it. ACCEL_PATCH_MATRIX=all runs every node here.
# One or two of each way a patch reaches the model: the sampling around it (ModelSampling*, CFG-style), its
# attention (PAG, SAG, ToMe), a block's output (FreeU), its weights (a LoRA, a merge).
CI_NODES = {"ModelSamplingDiscrete", "ModelSamplingContinuousEDM", "CFGZeroStar", "APG",
            "PerturbedAttentionGuidance", "SelfAttentionGuidance", "FreeU_V2", "TomePatchModel",
            "LoraLoaderModelOnly", "ModelMergeSimple"}
# Compile Model's defaults (choose auto, the background compile) on a handful; every node in the whole matrix.
DEFAULTS_FOR = {"FreeU", "ModelSamplingDiscrete", "PerturbedAttentionGuidance", "LoraLoaderModelOnly",
                "TomePatchModel"}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """The cases' results (tools.patch_matrix.summarize), written beside the test's server as patch_matrix.json."""
    base = tmp_path_factory.mktemp("patch-matrix")
    # the run's compile cache (tests/conftest.py): SD1.5's graphs at this size are the compile tests' too
    with ComfyServer(base, extra_nodes=(TEST_NODES,), api_nodes=False) as server:
        info = server.get_json("/object_info")
        nodes = list(patch_matrix.core_model_patches(info))
        run = nodes if FULL else [name for name in nodes if name in CI_NODES]
        cases = []
        for family in FAMILIES:
            defaults = set(run) if FULL else DEFAULTS_FOR & set(run)
            cases += patch_matrix.run_family(server, info, patch_matrix.families()[family], run,
                                             ("eager", "deepcache", "compiled", "defaults"), defaults)
        stats = server.get_json("/accel/stats")
    result = patch_matrix.summarize(cases, comfyui_version())
    (base / "patch_matrix.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    return {"result": result, "found": nodes, "run": run, "stats": stats}


def _ran(matrix):
    """(node, family, ways) of every case that ran without the pack."""
    return [(name, family, ways) for name, info in matrix["result"]["nodes"].items()
            for family, ways in info["families"].items() if not ways["eager"].get("error")]


def test_every_core_model_to_model_node_is_found_and_classified(matrix):
    found = matrix["found"]
    assert {"FreeU", "PerturbedAttentionGuidance", "ModelSamplingDiscrete", "LoraLoaderModelOnly"} <= set(found)
    assert len(found) >= 60, found  # 71 in 0.3.75, 94 in 0.33.0
    nodes = matrix["result"]["nodes"]
    assert sorted(nodes) == sorted(matrix["run"])
    verdicts = {(n, f): ways["verdict"] for n, info in nodes.items() for f, ways in info["families"].items()}
    assert all(verdicts.values()), verdicts
    ran = _ran(matrix)
    if FULL:
        assert len(ran) >= 45, f"only {len(ran)} cases ran: {verdicts}"
        return
    assert {name for name, _, _ in ran} == set(matrix["run"]), f"a node of the subset did not run: {verdicts}"
    committed = patch_matrix.MATRIX_DIR / f"{comfyui_version()}.json"
    assert committed.exists(), f"no matrix result for ComfyUI {comfyui_version()}: run python -m tools.patch_matrix"
    classified = json.loads(committed.read_text())["nodes"]
    unclassified = sorted(name for name in found if not any(
        ways.get("verdict") for ways in classified.get(name, {}).get("families", {}).values()))
    assert not unclassified, (f"core nodes {unclassified} are not in {committed.name}: run `python -m "
                              "tools.patch_matrix` (then --render) on this ComfyUI to classify them")


def test_compiled_and_deepcache_equal_the_same_patch_without_the_pack(matrix):
    wrong = {}
    for name, family, ways in _ran(matrix):
        for way in ("compiled", "deepcache", "defaults"):
            row = ways.get(way)
            if row is not None and (row.get("error") or not row.get("equal")):
                wrong[(name, family, way)] = row
    assert not wrong, json.dumps({str(k): v for k, v in wrong.items()}, indent=1)[:6000]


def test_a_patch_that_changes_the_output_still_changes_it_under_the_pack(matrix):
    changed = [(name, family, ways) for name, family, ways in _ran(matrix) if ways["eager"].get("changes_output")]
    # FreeU's own channel counts are not in the small UNet: it is one of those that change nothing here
    assert len(changed) >= (20 if FULL else 6), [n for n, _, _ in changed]
    assert {"PerturbedAttentionGuidance", "CFGZeroStar", "LoraLoaderModelOnly"} <= {n for n, _, _ in changed}
    # equal to the patched output, which differs from the unpatched one: the patch was not dropped
    for name, family, ways in changed:
        assert ways["compiled"]["equal"] and ways["deepcache"]["equal"], (name, family, ways)


def test_patches_of_the_sampling_alone_keep_every_block_call_compiled(matrix):
    """ModelSampling*, CFG-style guidance, sigma and denoise-mask patches: counted by each Compile Model node's own
    status, every block call of their models ran compiled."""
    seen = 0
    for name, family, ways in _ran(matrix):
        if name not in patch_matrix.SAMPLING_ONLY:
            continue
        seen += 1
        compiled = ways["compiled"]
        assert compiled["compiled_calls"] > 0 and compiled["eager_calls"] == {}, (name, family, compiled)
    assert seen >= (15 if FULL else len(CI_NODES & set(patch_matrix.SAMPLING_ONLY))), seen


def test_attention_patches_run_their_block_calls_eagerly_and_say_why(matrix):
    nodes = matrix["result"]["nodes"]
    pag = nodes["PerturbedAttentionGuidance"]["families"]["sd15"]["compiled"]
    # PAG's own call replaces self-attention (eager); the sampler's calls stay compiled
    assert pag["compiled_calls"] > 0 and list(pag["eager_calls"]) == [patch_matrix.PATCHED_REASON], pag
    counters = matrix["stats"]["counters"]
    assert counters.get("compile_model.passed_through", 0) >= 1, counters


# -- item 4, in-process: patches the pack passes through ------------------------------------------------------------

@pytest.fixture(scope="module")
def small(engine, comfy_nodes):
    model = load(comfy_nodes)
    return {"model": model, "eager": sample(model, steps=2, seed=5)}


def _own_lines(caplog, owner: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"(node {owner})" in r.getMessage()]


def test_a_patch_the_pack_does_not_know_runs_eagerly_with_one_line_and_a_count(engine, accel_pack, small, caplog):
    """0.33's "mlp_patch" (AnimaLLLiteApply) acts inside Cosmos blocks, where a compiled block given fresh options
    would drop it: a patch key the pack does not know makes the block calls it reaches run eagerly."""
    def mlp_patch(args):
        return args

    patched = small["model"].clone()
    patched.set_model_patch(mlp_patch, "mlp_patch")
    counters = accel_pack.accel.telemetry
    before = counters.snapshot()["counters"].get("compile_model.passed_through", 0)
    model = engine.compile_model(patched, engine.CompileOptions(choose="always compiled"), owner="unknown-patch")
    with caplog.at_level(logging.INFO, logger="comfyui_accel"):
        out = sample(model, steps=2, seed=5)
        sample(model, steps=2, seed=6)
    assert_close_to_eager(out, small["eager"], "an unknown patch, passed through")
    calls = engine.status.owner_calls("unknown-patch")
    reasons = list(calls["eager"])
    # the blocks that take transformer_options (SpatialTransformers) run eagerly; ResBlocks, which never see a
    # patch, stay compiled
    assert calls["compiled"] > 0 and len(reasons) == 1 and calls["eager"][reasons[0]] > 0, calls
    assert "does not know" in reasons[0] and "mlp_patch" in reasons[0] and "mlp_patch" in reasons[0], reasons
    assert "test_core_patches" in reasons[0], reasons  # where the patch comes from: its module
    lines = _own_lines(caplog, "unknown-patch")
    assert len(lines) == 1 and "mlp_patch" in lines[0], lines  # one line over two prompts
    assert counters.snapshot()["counters"]["compile_model.passed_through"] == before + 1


def test_another_nodes_block_replacements_pass_through_with_one_line_each(engine, small, caplog):
    """An attention replacement (ComfyUI's `set_model_attn1_replace`, as PAG's and other packs' nodes make) and a
    block whose forward another node set: both run as ComfyUI runs them, said once on the node, counted."""
    def attn1_replace(n, context, value, extra_options):
        return value  # self-attention as the identity, as PAG's perturbed call makes it

    replaced = small["model"].clone()
    replaced.set_model_attn1_replace(attn1_replace, "middle", 0)
    model = engine.compile_model(replaced, engine.CompileOptions(choose="always compiled"), owner="replaced")
    with caplog.at_level(logging.INFO, logger="comfyui_accel"):
        out = sample(model, steps=2, seed=5)
    assert_close_to_eager(out, sample(replaced, steps=2, seed=5), "attention replaced, passed through")
    calls = engine.status.owner_calls("replaced")
    assert calls["compiled"] > 0 and calls["eager"].get(patch_matrix.PATCHED_REASON, 0) > 0, calls
    assert len(_own_lines(caplog, "replaced")) == 1

    unet = small["model"].model.diffusion_model
    block = next(m for m in unet.modules() if type(m).__name__ == "ResBlock")
    block.forward = type(block).forward.__get__(block)  # another node's own forward on this one block
    try:
        model = engine.compile_model(small["model"].clone(), engine.CompileOptions(choose="always compiled"),
                                     owner="own-forward")
        with caplog.at_level(logging.INFO, logger="comfyui_accel"):
            out = sample(model, steps=2, seed=5)
            sample(model, steps=2, seed=6)
    finally:
        del block.forward
    assert_close_to_eager(out, small["eager"], "a block with its own forward")
    calls = engine.status.owner_calls("own-forward")
    assert calls["compiled"] > 0 and calls["eager"].get("another node set the block's own forward", 0) > 0, calls
    lines = _own_lines(caplog, "own-forward")
    assert len(lines) == 1 and "own forward" in lines[0], lines


def test_sampling_patches_keep_their_calls_compiled_in_process(engine, small):
    """The call counts a node's status gives are its own model's: a CFG patch on a clone counts only compiled
    calls, whatever another node's model of the same kinds ran eagerly before."""
    patched = small["model"].clone()
    patched.set_model_sampler_cfg_function(lambda args: args["uncond"] + (args["cond"] - args["uncond"]) * 4.0)
    model = engine.compile_model(patched, engine.CompileOptions(choose="always compiled"), owner="cfg-only")
    out = sample(model, steps=2, seed=5)
    assert_close_to_eager(out, sample(patched, steps=2, seed=5), "a CFG function under Compile Model")
    calls = engine.status.owner_calls("cfg-only")
    assert calls["compiled"] > 0 and calls["eager"] == {}, calls
    assert not torch.equal(out, small["eager"])
