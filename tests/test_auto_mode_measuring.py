"""Measuring never changes a result: every path of auto mode that times, compares or captures blocks (the profile
call, the per-kind choice, the whole-call check, the background capture) leaves each call's output exactly what
eager calls give, for blocks that add into their inputs in place (as ComfyUI's Flux blocks do), return views of
their inputs, or keep state between calls.

The blocks are a small torch model of the test's own, hosted the way ComfyUI hosts a diffusion model: a real
ModelPatcher, whose APPLY_MODEL wrappers run through ComfyUI's own WrapperExecutor, as BaseModel.apply_model
runs them. Every call is compared with a copy of the same model called eagerly with the same inputs.
"""
from __future__ import annotations


import pytest
import torch

DIM = 32


class InPlaceBlock(torch.nn.Module):
    """Adds into its input and returns it, like `img += ...` in ComfyUI's Flux blocks."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        x += torch.tanh(self.lin(x))
        return x


class ViewBlock(torch.nn.Module):
    """Changes its input in place and returns a view of it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        x.mul_(0.5).add_(torch.tanh(self.lin(x)))
        return x.view(x.shape[0], -1, DIM)


class CountingBlock(torch.nn.Module):
    """Keeps state between calls: its output depends on how often it ran."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x + torch.tanh(self.lin(x)) * self.calls


class LoneBlock(torch.nn.Module):
    """The only block of its kind, in a top-level list of one (a DiT of depth 1)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        x += torch.tanh(self.lin(x)) * 0.5
        return x


class ToyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.in_place = torch.nn.ModuleList([InPlaceBlock() for _ in range(3)])
        self.views = torch.nn.ModuleList([ViewBlock() for _ in range(2)])
        self.counting = torch.nn.ModuleList([CountingBlock() for _ in range(2)])
        self.lone = torch.nn.ModuleList([LoneBlock()])

    def forward(self, x):
        h = x * 1.0  # the blocks may change h, never the caller's x
        for block in (*self.in_place, *self.views, *self.counting, *self.lone):
            h = block(h)
        return h


class ToyBaseModel(torch.nn.Module):
    """What the APPLY_MODEL wrapper sees of a ComfyUI BaseModel: `diffusion_model`, and apply_model running the
    patcher's wrappers through ComfyUI's WrapperExecutor."""

    def __init__(self):
        super().__init__()
        self.diffusion_model = ToyNet()

    def apply_model(self, x, transformer_options):
        import comfy.patcher_extension as ext

        wrappers = ext.get_all_wrappers(ext.WrappersMP.APPLY_MODEL, transformer_options)
        return ext.WrapperExecutor.new_class_executor(self._apply_model, self, wrappers).execute(x, transformer_options)

    def _apply_model(self, x, transformer_options):
        return self.diffusion_model(x)


@pytest.fixture(autouse=True)
def quiet_pack(accel_pack):
    """These tests need every call's timing: a sample taken while the pack's own work runs (a child compiling, the
    CPU checks) is dropped (background/activity.py), so an earlier test's child still compiling in this process
    would leave their kinds undecided (it did once: all 16 calls' samples dropped)."""
    assert accel_pack.accel.compile.background.BACKGROUND.wait(timeout=300), "an earlier test's compile never ended"


def toy_patcher():
    import comfy.model_patcher

    torch.manual_seed(0)
    model = ToyBaseModel().requires_grad_(False)
    return comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))


def call(patcher, x):
    with torch.no_grad():
        return patcher.model.apply_model(x, {"wrappers": patcher.wrappers})


@pytest.mark.parametrize("background", [False, True], ids=["in-process", "background-capture"])
def test_every_measuring_path_leaves_each_call_as_eager(accel_pack, monkeypatch, tmp_path, background):
    engine = accel_pack.accel.compile
    # A compile cache of its own: a cache holding these kinds from an earlier run would skip the background path.
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "compile-cache"))
    # Compiled always counts as faster per kind, so that after the profile call and the per-kind choice the
    # model goes on to the whole-call check: every measuring path runs on these calls.
    monkeypatch.setattr(engine.kind_choice, "FASTER_MARGIN", 1e9)
    monkeypatch.setattr(engine.kind_choice, "MIN_CALL_SHARE", 0.0)  # tiny blocks: no kind too small to compile
    patcher = toy_patcher()
    eager = toy_patcher()  # the same weights, called eagerly, call for call
    assert torch.equal(patcher.model.diffusion_model.lone[0].lin.weight, eager.model.diffusion_model.lone[0].lin.weight)
    # each variant its own kinds (other options), so each decides everything anew
    options = engine.CompileOptions(dynamic="dynamic" if background else "static", background=background)
    compiled = engine.compile_model(patcher, options)
    generator = torch.Generator().manual_seed(1)
    modes = []
    record = None
    for step in range(16):
        x = torch.randn(2, 4, DIM, generator=generator)
        x_before = x.clone()
        out = call(compiled, x)
        expected = call(eager, x.clone())
        assert torch.equal(x, x_before), f"call {step}: the caller's input was changed"
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=f"call {step}: output differs from eager")
        record = engine.model_record.records_of(patcher.model)[0]
        modes.append(record.auto.verdict or record.auto.status(record.entries))
        if background and step == 1:
            engine.background.BACKGROUND.wait(timeout=300)  # the child fails (the toy blocks do not import there)
    # the stateful blocks ran exactly once per call, as eagerly
    counts = [b.calls.item() for b in patcher.model.diffusion_model.counting]
    assert counts == [16.0, 16.0], counts
    kinds = {e.kind.label.split("[")[0]: e for e in record.entries}
    assert set(kinds) == {"InPlaceBlock", "ViewBlock", "CountingBlock", "LoneBlock"}, set(kinds)
    assert all(e.choice.decided and e.choice.share is not None for e in kinds.values()), \
        {k: (e.stats()["reason"], e.choice.dropped.describe()) for k, e in kinds.items()}
    assert all(e.compiles >= 1 for e in kinds.values()), {k: e.stats() for k, e in kinds.items()}
    assert record.auto.verdict in ("compiled", "eager") and record.auto.calls >= 4, (record.auto, modes)
    if background:  # captured in the first call, sent to a child, which cannot import the toy blocks: failed
        states = {k: e.background.state for k, e in kinds.items()}
        assert all(s is engine.background.BackgroundState.FAILED for s in states.values()), states


def test_each_kind_runs_the_route_planned_for_its_call(accel_pack, monkeypatch):
    """Each model call's routes are decided once, before the call (routes.py), one per kind, and every block runs
    its kind's route: the profile call eagerly and uncounted, the per-kind timing on the chosen paths, a
    whole-call eager sample through ComfyUI's own forward, then (the verdict compiled) every block compiled; with
    choose="always compiled" every kind's route is COMPILED from the first call."""
    engine = accel_pack.accel.compile
    Route, CallMode = engine.routes.Route, engine.routes.CallMode
    monkeypatch.setattr(engine.kind_choice, "FASTER_MARGIN", 1e9)  # compiled wins every comparison: a verdict
    monkeypatch.setattr(engine.auto_mode, "WHOLE_CALL_MARGIN", 1e9)
    monkeypatch.setattr(engine.kind_choice, "MIN_CALL_SHARE", 0.0)
    plans, plan_call = [], engine.patcher.plan_call

    def recording(*args, **kwargs):
        plans.append(plan_call(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(engine.patcher, "plan_call", recording)
    patcher = toy_patcher()
    blocks = 8
    generator = torch.Generator().manual_seed(2)
    for choose in ("auto", "always compiled"):
        # options of this test's own, so that its kinds decide everything anew whatever ran before
        compiled = engine.compile_model(patcher, engine.CompileOptions(dynamic="auto", background=False,
                                                                       choose=choose))
        plans.clear()
        calls = []
        for _ in range(14):
            call(compiled, torch.randn(2, 4, DIM, generator=generator))
            (record,) = [r for r in engine.model_record.records_of(patcher.model) if r.options.choose == choose]
            calls.append(dict(record.last_call))
        kinds = {e.key for e in record.entries}
        assert len(kinds) == 4 and all(set(p.routes) == kinds for p in plans), [p.routes for p in plans]
        routes = [(p.mode, set(p.routes.values())) for p in plans]
        if choose == "always compiled":
            assert all(r == (CallMode.DISPATCH, {Route.COMPILED}) for r in routes), routes
            assert all(c["compiled"] == blocks and not c["eager"] for c in calls), calls
            continue
        assert routes[0] == (CallMode.PROFILE, {Route.PROFILE}) and calls[0]["compiled"] == 0, (routes, calls)
        assert not calls[0]["eager"], calls[0]  # the profile's eager calls are ComfyUI's forward, uncounted
        expected = {CallMode.DISPATCH: {Route.CHOSEN}, CallMode.CHECK_COMPILED: {Route.CHOSEN},
                    CallMode.CHECK_EAGER: {Route.PLAIN}}
        assert all(found == expected[mode] for mode, found in routes[1:]), routes
        for (mode, _), done in zip(routes, calls):
            if mode is CallMode.CHECK_EAGER:
                assert done["compiled"] == 0 and not done["eager"], done
            if mode is CallMode.CHECK_COMPILED:
                assert done["compiled"] == blocks, done
        modes = [mode for mode, _ in routes]
        assert CallMode.CHECK_EAGER in modes and record.auto.verdict == "compiled", (modes, record.auto.reason)
        assert modes[-1] is CallMode.DISPATCH and calls[-1]["compiled"] == blocks, (modes, calls[-1])
