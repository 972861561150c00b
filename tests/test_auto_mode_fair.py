"""Auto mode decides on fair measurements and never makes a prompt wait for a compile (issue #32):

- no sample is taken while the pack's own work runs: a real background child compiling, here;
- a kind's compiled and eager calls are compared at one input shape, never one shape against another;
- an eager verdict that was a close call is checked again a few sampling runs later, a clear one never;
- with the defaults, a prompt at a new size, a batch of 1 (cfg 1 drops the uncond half) or 2 runs what the
  compiled graphs do not serve eagerly, compiles nothing in the prompt, and loads the child's graphs between
  prompts.

The toy models are hosted the way ComfyUI hosts a diffusion model (test_auto_mode_measuring.py): a real
ModelPatcher whose APPLY_MODEL wrappers run through ComfyUI's own WrapperExecutor. Compiles are counted with
Dynamo's own counter.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_auto_mode_measuring import ToyBaseModel, call
from tools.harness.child import read_result


def record_of(engine, patcher):
    (record,) = engine.model_record.records_of(patcher.model)
    return record


class StackNet(torch.nn.Module):
    """Three blocks of one kind; `dim` makes the kind's signature, so each test gets kinds no other decided."""

    def __init__(self, dim: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(dim, dim) for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x


def hosted(net: torch.nn.Module, base_model=ToyBaseModel):
    """`net` as a ComfyUI ModelPatcher's diffusion model."""
    import comfy.model_patcher

    base = base_model()
    base.diffusion_model = net
    base.requires_grad_(False)
    return comfy.model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))


class TwoSizeNet(torch.nn.Module):
    """One block kind called at two input sizes in every call, alternately, as a UNet's SpatialTransformer runs
    at two resolutions: a large call costs hundreds of times a small one."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(4)])

    def forward(self, x):
        big, small = x, x[:8]
        outs = [block(big if i % 2 == 0 else small) for i, block in enumerate(self.blocks)]
        return outs[0] + outs[2] + outs[1].sum() + outs[3].sum()


class ReferenceNet(torch.nn.Module):
    """Three blocks of one kind over the image's tokens joined by a list of reference latents' tokens, as Flux
    Kontext's and Qwen-Image-Edit's forward join `ref_latents` (a list in the conditioning) to the image's."""

    def __init__(self, dim: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(dim, dim) for _ in range(3)])

    def forward(self, x, ref_latents=()):
        tokens = x.shape[1]
        x = torch.cat([x, *ref_latents], dim=1)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x[:, :tokens]


class ConditionedBaseModel(ToyBaseModel):
    """A ToyBaseModel whose apply_model takes the conditioning as keyword arguments, as BaseModel's does."""

    def apply_model(self, x, transformer_options, **conditioning):
        import comfy.patcher_extension as ext

        wrappers = ext.get_all_wrappers(ext.WrappersMP.APPLY_MODEL, transformer_options)
        return ext.WrapperExecutor.new_class_executor(self._apply_model, self, wrappers).execute(
            x, transformer_options, **conditioning)

    def _apply_model(self, x, transformer_options, **conditioning):
        return self.diffusion_model(x, **conditioning)


def test_samples_beside_a_background_compile_are_dropped(engine, monkeypatch, tmp_path):
    """While a real child process compiles (started at once here), another model's profile call and whole-call
    samples are refused, counted, and its verdict waits; once the child is gone, the verdict comes from clean
    samples and says how many were dropped."""
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))
    monkeypatch.setenv("ACCEL_BACKGROUND_AT_ONCE", "1")
    monkeypatch.setattr(engine.kind_choice, "MIN_CALL_SHARE", 0.0)
    generator = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    patcher = hosted(StackNet(56))  # kinds of its own: no other test decided them

    def measured_call():
        x = torch.randn(2, 4, 56, generator=generator)
        torch.testing.assert_close(call(measured, x), patcher.model.diffusion_model(x), rtol=1e-4, atol=1e-4)

    measured = engine.compile_model(patcher, engine.CompileOptions(dynamic="static", background=False))
    for _ in range(2):  # its profile call, then the call that compiles its kinds (and times a few calls)
        measured_call()
    # another model's kinds go to a child, which starts now (and fails: this test's blocks do not import there)
    sender = engine.compile_model(hosted(StackNet(60)), engine.CompileOptions(dynamic="static"))
    call(sender, torch.randn(2, 4, 60, generator=generator))
    assert engine.background.BACKGROUND.compiling(), "the child did not start"
    calls_beside = 0
    while engine.background.BACKGROUND.compiling() and calls_beside < 6:
        measured_call()
        calls_beside += 1
    record = record_of(engine, measured)
    assert calls_beside >= 1, "the child ended before a call could be made beside it"
    dropped = [record.auto.dropped, *(e.choice.dropped for e in record.entries)]
    works = [work for d in dropped for work in d.by_work]
    assert sum(d.total for d in dropped) >= 1 and all("a background compile" in work for work in works), works
    assert record.auto.verdict is None, record.auto.reason
    assert all(not e.choice.decided for e in record.entries), "a kind decided from samples beside the child"
    assert engine.background.BACKGROUND.wait(timeout=300)
    for _ in range(20):
        measured_call()
        if record.auto.verdict is not None:
            break
    assert record.auto.verdict in ("compiled", "eager"), record.auto.status(record.entries)
    reasons = [e.choice.reason for e in record.entries if e.choice.dropped.total]
    assert reasons and all("clean samples" in r and "while a background compile" in r for r in reasons), reasons
    assert any(k["dropped_samples"] for k in (e.stats() for e in record.entries))


def test_kind_timing_compares_calls_of_one_input_shape(engine, monkeypatch, tmp_path):
    """A kind's compiled and eager samples are compared at one input shape: alternating sides over alternating
    sizes once timed every compiled call at the large size and every eager one at the small, so compiled looked
    hundreds of times slower. Timed per shape, the two paths of this plain Linear are within a few times."""
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))
    monkeypatch.setattr(engine.kind_choice, "MIN_CALL_SHARE", 0.0)
    patcher = hosted(TwoSizeNet())
    compiled = engine.compile_model(patcher, engine.CompileOptions(dynamic="static", background=False))
    x = torch.randn(4096, 64)
    for _ in range(12):
        torch.testing.assert_close(call(compiled, x), patcher.model.diffusion_model(x), rtol=1e-4, atol=1e-4)
    (entry,) = {e.key: e for e in record_of(engine, compiled).entries}.values()
    assert entry.choice.decided, entry.stats()
    timings = entry.choice.timings
    assert timings["compiled_s"] < 5 * timings["eager_s"], (timings, entry.choice.reason)
    assert "4096x64" in entry.choice.reason, entry.choice.reason  # decided on the large calls, each side


@pytest.mark.parametrize("band, rechecked, dim", [(1e9, True, 40), (0.0, False, 48)],
                         ids=["close-call", "clear-call"])
def test_a_close_eager_verdict_is_checked_again_a_clear_one_is_not(engine, monkeypatch, tmp_path, band,
                                                                    rechecked, dim):
    """An eager whole-call verdict within the re-check band is checked again after RECHECK_AFTER_RUNS sampling
    runs, from real calls, at most MAX_RECHECKS times; one outside it holds. Outputs equal eager throughout. The
    margins are forced so each outcome is certain: compiled never counts as faster for whole calls (eager
    verdict), always per kind (so there is a whole-call check to make)."""
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))
    monkeypatch.setattr(engine.kind_choice, "MIN_CALL_SHARE", 0.0)
    monkeypatch.setattr(engine.kind_choice, "FASTER_MARGIN", 1e9)
    monkeypatch.setattr(engine.auto_mode, "WHOLE_CALL_MARGIN", 0.0)
    monkeypatch.setattr(engine.auto_mode, "RECHECK_BAND", band)
    gate = engine.background.IDLE_GATE
    torch.manual_seed(dim)
    patcher = hosted(StackNet(dim))
    compiled = engine.compile_model(patcher, engine.CompileOptions(dynamic="static", background=False))
    generator = torch.Generator().manual_seed(5)
    record = None

    def calls_until_verdict(limit: int = 40) -> None:
        nonlocal record
        for _ in range(limit):
            x = torch.randn(2, 4, dim, generator=generator)
            expected = patcher.model.diffusion_model(x)
            torch.testing.assert_close(call(compiled, x), expected, rtol=1e-4, atol=1e-4)
            record = record_of(engine, compiled)
            if record.auto.verdict is not None:
                return

    def sampling_runs(n: int) -> None:  # what the OUTER_SAMPLE wrapper tells the gate at each sampler run
        for _ in range(n):
            gate.sampling_started()
            gate.sampling_ended()

    calls_until_verdict()
    assert record.auto.verdict == "eager" and record.auto.close_call == rechecked, record.auto
    for recheck in range(1, engine.kind_choice.MAX_RECHECKS + 2):
        sampling_runs(engine.kind_choice.RECHECK_AFTER_RUNS - 1)
        calls_until_verdict(1)
        assert record.auto.verdict == "eager" and record.auto.rechecks == recheck - 1, "re-checked too early"
        sampling_runs(1)
        calls_until_verdict(1)
        due = rechecked and recheck <= engine.kind_choice.MAX_RECHECKS
        assert (record.auto.verdict is None) == due, (recheck, record.auto)
        assert record.auto.rechecks == (recheck if due else recheck - 1 if rechecked else 0), record.auto
        calls_until_verdict()
        assert record.auto.verdict == "eager", record.auto
        if not rechecked:
            break


PROMPT_CHANGES_PROBE = Path(__file__).with_name("prompt_changes_probe.py")


@pytest.mark.full(why=(
    "size and batch changes under the defaults; make test runs test_compile_video_families.py's frames, "
    "size and batch test on Wan 2.2 and test_a_new_reference_latent_size_compiles_nothing_in_the_call"))
def test_no_compile_in_a_prompt_after_a_size_batch_or_cfg_change(tmp_path):
    """The defaults on the small SD1.5 UNet through ComfyUI's sampler, in a fresh process (its kinds have met only
    this test's inputs): after the first configuration is compiled and loaded, a prompt at another size, one at
    cfg 1 (a batch of 1: Dynamo specialises size 1), and one with a batch of 2 each compile nothing in the prompt
    (Dynamo's frames) and equal eager, while what the graphs do not serve goes to a child; after that one round of
    children, the same prompts run every block compiled, and still compile nothing in the prompt."""
    env = {**os.environ, "ACCEL_CACHE_DIR": str(tmp_path / "compile-cache")}
    proc = subprocess.run([sys.executable, str(PROMPT_CHANGES_PROBE)], capture_output=True, text=True, env=env,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = read_result(proc.stdout)
    assert all(result["waits"]), f"a child did not finish: {result['waits']}"
    assert result["verdict"] == "compiled", result["status"]
    for round_, ran in enumerate(result["rounds"]):
        for sampling in ran["samplings"]:
            assert sampling["frames"] == 0, f"round {round_}: {sampling} compiled in the prompt"
            assert sampling["unlike_eager"] is None, f"round {round_}: {sampling['unlike_eager']}"
    first, second = result["rounds"]
    assert first["new_shape_eager_calls"] > 0, "no block met inputs its graphs do not serve"
    assert second["new_shape_eager_calls"] == 0, "after the children, some blocks still ran eagerly"


def test_a_call_cut_short_after_a_capture_still_sends_it_to_the_background(engine, monkeypatch, tmp_path):
    """ComfyUI's Cancel (its ops raise InterruptProcessingException) or an out-of-memory error inside the model's
    first call, after the first block of a cold kind was captured for the background compiler: before, the capture
    was dropped with the call, and the kind waited for a compile nobody started, eager for the rest of the
    process. Now the capture goes to the background when the call ends, however it ends, and the kind settles."""
    import comfy.model_management

    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))  # the kind new to the cache: captured
    net = StackNet(44)
    compiled = engine.compile_model(hosted(net), engine.CompileOptions())

    def cancel(module, args):  # the user presses Cancel while the second block is about to run
        comfy.model_management.interrupt_current_processing(True)
        comfy.model_management.throw_exception_if_processing_interrupted()  # what ComfyUI's ops call first

    hook = net.blocks[1].register_forward_pre_hook(cancel)
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            call(compiled, torch.randn(2, 4, 44))
    finally:
        hook.remove()
    (entry,) = {e.key: e for e in record_of(engine, compiled).entries}.values()
    assert entry.stats()["background"]["state"] != "queued", "the capture was dropped with the call"
    assert engine.background.BACKGROUND.wait(timeout=300), "the background compile did not finish"
    x = torch.randn(2, 4, 44)
    torch.testing.assert_close(call(compiled, x.clone()), net(x), rtol=1e-4, atol=1e-4)
    assert entry.stats()["background"]["state"] in ("done", "failed"), entry.stats()["background"]


class CancellableBlock(torch.nn.Module):
    """A block that checks ComfyUI's Cancel between two ops, as every op of ComfyUI's own layers does."""

    def __init__(self, dim: int):
        super().__init__()
        self.first, self.second = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        import comfy.model_management

        x = self.first(x)
        comfy.model_management.throw_exception_if_processing_interrupted()
        return self.second(x)


def test_cancel_inside_a_compiled_call_ends_the_prompt_and_keeps_the_kind_compiled(engine, monkeypatch, tmp_path):
    """ComfyUI's Cancel raised inside a compiled block's call: before, it was taken for a failed compile, the kind
    lost its compiled path for good, and the block ran again eagerly with the flag already cleared, so the prompt
    went on. Now it ends the call, as in eager ComfyUI, and the kind stays compiled."""
    import comfy.model_management

    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))
    net = StackNet(36)
    net.blocks = torch.nn.ModuleList([CancellableBlock(36) for _ in range(3)])
    compiled = engine.compile_model(hosted(net), engine.CompileOptions(choose="always compiled", background=False))
    x = torch.randn(2, 4, 36)
    torch.testing.assert_close(call(compiled, x.clone()), net(x), rtol=1e-4, atol=1e-4)  # compiles the kind
    comfy.model_management.interrupt_current_processing(True)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        call(compiled, x.clone())
    (entry,) = {e.key: e for e in record_of(engine, compiled).entries}.values()
    assert entry.failure is None and entry.path == "compiled", (entry.failure, entry.path, entry.reason)
    torch.testing.assert_close(call(compiled, x.clone()), net(x), rtol=1e-4, atol=1e-4)


class AddsIntoItsInput(torch.nn.Module):
    """Adds into its input in place, as ComfyUI's Flux blocks do, then breaks the graph: Dynamo makes two graphs
    and runs the first before it compiles the second."""

    def __init__(self, dim: int):
        super().__init__()
        self.first, self.second = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        x += torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return x + torch.tanh(self.second(x))


def test_a_compile_that_fails_after_a_graph_changed_the_inputs_falls_back_on_the_inputs_given(engine, monkeypatch,
                                                                                              tmp_path):
    """A block compiled as two graphs, whose second graph fails to compile (a backend registered through torch's
    registry that refuses all but the first graph it is given): the first graph had run and added into the
    block's input. Before, the call was made again and the eager fallback ran on the changed input (the addition
    two or three times over); now both see the input as it was given, and the output is eager's."""
    import torch._dynamo

    graphs = []

    def first_graph_only(graph_module, example_inputs):
        graphs.append(graph_module)
        if len(graphs) > 1:
            raise RuntimeError("injected failure of a later graph")
        return graph_module.forward

    if "accel_test_first_graph_only" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(first_graph_only, name="accel_test_first_graph_only")
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))
    net = StackNet(52)
    net.blocks = torch.nn.ModuleList([AddsIntoItsInput(52) for _ in range(3)])
    compiled = engine.compile_model(hosted(net), engine.CompileOptions(
        backend="accel_test_first_graph_only", choose="always compiled", background=False))
    x = torch.randn(2, 4, 52)
    expected = net(x.clone())
    torch.testing.assert_close(call(compiled, x.clone()), expected, rtol=1e-5, atol=1e-5)
    (entry,) = {e.key: e for e in record_of(engine, compiled).entries}.values()
    assert entry.failure is not None and "injected failure" in entry.failure, entry.failure


def test_another_nodes_forward_on_a_block_keeps_running_and_stays(engine, monkeypatch, tmp_path):
    """A node that patches one block by setting its own `forward` on the block: Compile Model leaves that block to
    it. Before, the dispatcher put on the block for each call ran the class's forward in its place (another
    output) and, removed after the call, took the node's forward away with it."""
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))
    net = StackNet(28)
    patched_block = net.blocks[1]
    original = patched_block.forward
    patched_block.forward = lambda x: original(x) * 1.5  # as such a node sets it
    compiled = engine.compile_model(hosted(net), engine.CompileOptions(choose="always compiled", background=False))
    x = torch.randn(2, 4, 28)
    expected = net(x.clone())
    for _ in range(2):
        torch.testing.assert_close(call(compiled, x.clone()), expected, rtol=1e-4, atol=1e-4)
        assert "forward" in patched_block.__dict__, "the node's forward was taken away"


def test_a_new_reference_latent_size_compiles_nothing_in_the_call(engine, monkeypatch, tmp_path):
    """The defaults, with the kind's graphs traced in this process (ACCEL_PRECOMPILED=0 here; also where torch lacks
    AOT precompile or a kind could not be saved whole): once the model's calls settle, a repeat of a settled call's
    inputs skips the blocks' look for a new shape. The call's inputs were keyed by its tensors alone, so a new
    reference latent size (a list in the conditioning) at the same image size counted as a repeat, and its blocks'
    new token count compiled in the call, in the prompt (1 frame). Now the list's shapes are in the key: the call
    runs those blocks eagerly, equal to eager, while a child compiles their graph."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))
    monkeypatch.setenv("ACCEL_PRECOMPILED", "0")
    monkeypatch.setattr(engine.kind_choice, "MIN_CALL_SHARE", 0.0)
    monkeypatch.setattr(engine.kind_choice, "FASTER_MARGIN", 1e9)  # compiled kept: where compiles happen is tested
    monkeypatch.setattr(engine.auto_mode, "WHOLE_CALL_MARGIN", 1e9)
    torch.manual_seed(52)
    net = ReferenceNet(52).requires_grad_(False)
    compiled = engine.compile_model(hosted(net, ConditionedBaseModel), engine.CompileOptions())

    def frames_of_call(reference_tokens: int) -> int:
        x, refs = torch.randn(2, 6, 52), [torch.randn(2, reference_tokens, 52)]
        frames = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            out = compiled.model.apply_model(x, {"wrappers": compiled.wrappers}, ref_latents=refs)
        torch.testing.assert_close(out, net(x, ref_latents=refs), rtol=1e-4, atol=1e-4)
        return counters["stats"]["unique_graphs"] - frames

    record = None
    for _ in range(15):  # profiled, compiled by a child, traced here, timed and checked: settled
        frames_of_call(4)
        assert engine.background.BACKGROUND.wait(timeout=300)
        record = record_of(engine, compiled)
        if record.auto.verdict is not None:
            break
    assert record.auto.verdict == "compiled", record.auto.status(record.entries)
    assert frames_of_call(4) == 0 and record.last_call["compiled"] == 3, record.last_call  # a settled repeat
    assert frames_of_call(8) == 0, f"a new reference size compiled in the call: {record.last_call}"
    assert record.last_call["eager"] == {engine.dispatch.NEW_SHAPE_IN_BACKGROUND: 3}, record.last_call
    # The child compiling the new size is this test's: it ends here, not beside the next test's timed calls (a
    # sample taken while the pack's own work runs is dropped, so a test that times calls would decide nothing).
    assert engine.background.BACKGROUND.wait(timeout=300), "the background compile did not finish"
