"""CUDA graphs over compiled blocks (accel/compile/cuda_graphs.py, opt-in with ACCEL_CUDA_GRAPHS=1): which kinds may
replay a graph given the device, the policy, the kind's route, the load state and weights that moved; the
whole-step check that keeps them only where faster; and on this CPU, the option's plumbing: off, said in the node's
status and the log, and the sampling as without it. The capture and replay need CUDA: nothing here runs them."""
from __future__ import annotations

import logging

import pytest
import torch

from compile_helpers import assert_close_to_eager, load, sample


@pytest.fixture(scope="module")
def graphs(accel_pack):
    return accel_pack.accel.compile.cuda_graphs


def test_plan_kind_says_why_graphs_are_off(graphs):
    plan, inputs = graphs.plan_kind, graphs.GraphInputs
    cases = [  # (inputs, graphed, words the reason must hold)
        (inputs(False, "cuda"), False, "not asked for"),
        (inputs(True, "cpu"), False, "need a CUDA device"),
        (inputs(True, "cuda", False, "CUDA graph trees do not work with the cudaMallocAsync allocator"), False,
         "cudaMallocAsync"),
        (inputs(True, "cuda", runs_compiled=False), False, "do not run compiled"),
        (inputs(True, "cuda", partially_loaded=True), False, "partially loaded"),
        (inputs(True, "cuda", recordings=graphs.MAX_RECORDINGS + 1), False, "weights moved"),
        (inputs(True, "cuda", recordings=graphs.MAX_RECORDINGS), True, "on"),
        (inputs(True, "cuda", whole_step_verdict="plain"), False, "not faster"),
        (inputs(True, "cuda", whole_step_verdict="graphed"), True, "on"),
        (inputs(True, "cuda"), True, "timing whole steps"),
    ]
    for state, graphed, words in cases:
        decision = plan(state)
        assert decision.graphed is graphed and words in decision.reason, (state, decision)


def test_whole_step_check_keeps_graphs_only_when_every_graphed_step_is_faster(graphs):
    faster, slower = graphs.GraphCheck(), graphs.GraphCheck()
    key = ((1, 16, 8, 8), "torch.float16", 6)
    sides = []
    for graphed_s, plain_s, check in ((0.010, 0.012, faster), (0.0118, 0.012, slower)):
        for _ in range(4):  # pairs: graphed, graphed, plain, plain
            side = check.next_side()
            sides.append(side)
            check.record(key, side, graphed_s if side == "graphed" else plain_s)
    assert sides[:4] == ["graphed", "graphed", "plain", "plain"]
    assert faster.verdict == "graphed" and faster.reason.startswith("on: ")
    assert slower.verdict == "plain" and slower.reason.startswith("off: "), slower.reason  # 1.7% is under the margin
    assert slower.next_side() == "plain"  # settled: no more alternating
    other = graphs.GraphCheck()
    other.record(key, "graphed", 0.01)
    other.record((("another shape",),), "plain", 0.02)
    assert other.verdict is None, "steps of different shapes or block counts are never compared"


def test_a_graph_key_holds_the_weights_addresses(graphs):
    block = torch.nn.Linear(4, 4)
    x = torch.zeros(2, 4)
    key = graphs.call_key((x,), {"transformer_options": {"patches": {}}, "scale": 1.0}, block)
    assert key == graphs.call_key((torch.ones(2, 4),), {"transformer_options": {"patches": {}}, "scale": 1.0}, block)
    assert key != graphs.call_key((torch.zeros(3, 4),), {"transformer_options": {"patches": {}}, "scale": 1.0}, block)
    block.weight = torch.nn.Parameter(block.weight.detach().clone())  # what a LoRA or Swap Weights puts in place
    assert key != graphs.call_key((x,), {"transformer_options": {"patches": {}}, "scale": 1.0}, block)
    values = (x, [x, {"a": x}], 3)
    assert len(graphs.tensors_of(values, [])) == 3
    replaced = graphs.replace_tensors(values, lambda t: t + 1)
    assert replaced[2] == 3 and bool((replaced[1][1]["a"] == 1).all())


def test_the_switch_turns_the_option_on(engine, monkeypatch):
    assert engine.CompileOptions().cuda_graphs is False
    for value, on in (("1", True), ("0", False), ("false", False), ("yes", True)):
        monkeypatch.setenv("ACCEL_CUDA_GRAPHS", value)
        assert engine.CompileOptions().cuda_graphs is on, value
    assert engine.CompileOptions(cuda_graphs=False).cuda_graphs is False


def test_on_the_cpu_graphs_are_off_and_said_so(engine, comfy_nodes, caplog):
    """The option's way through the node's engine on the CPU, without compiling (seconds, not minutes): the
    model's first call (auto mode's eager profile) runs, the log and the status say why graphs are off."""
    model = load(comfy_nodes)
    eager = sample(model, steps=1)
    options = engine.CompileOptions(background=False, cuda_graphs=True)
    compiled = engine.compile_model(model, options)
    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        out = sample(compiled, steps=1)
    # eager (the profile call) here; compiled where an earlier test of this process timed the kinds' shares
    assert_close_to_eager(out, eager, "cuda_graphs=True on the CPU vs eager")
    status = engine.status.model_status(compiled.model)
    assert status["text"].endswith("; CUDA graphs off: CUDA graphs need a CUDA device, this model runs on cpu"), status
    assert engine.cuda_graphs.status_line(False, "cuda", True, "") is None  # not asked: not said
    assert all(k["cuda_graphs"] is None for k in engine.REGISTRY.stats()["kinds"]), "a graph was captured on the CPU"
    warned = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    # once per device and process: another test of this process may have been warned first
    assert all("need a CUDA device" in w for w in warned), warned
