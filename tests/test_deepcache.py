"""DeepCache against a real ComfyUI: the small SD1.5-architecture UNet through ComfyUI's own sampler, compared
with the same model without DeepCache (eager) and with itself in other conditions."""
from __future__ import annotations

import inspect
import logging
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import deepcache_runs as runs
from deepcache_runs import RUN_A, deepcache, sample, split_cond_uncond


@pytest.fixture(scope="module")
def pack(accel_pack):
    return accel_pack


@pytest.fixture(scope="module")
def unet(comfy_dir):
    import nodes

    (model,) = nodes.UNETLoader().load_unet(runs.SMALL, "default")
    return model


def run_a_kwargs():
    return dict(size=RUN_A["size"], batch=RUN_A["batch"], steps=RUN_A["steps"], seed=RUN_A["seed"])


@pytest.fixture(scope="module")
def eager(unet):
    """Run A's settings without DeepCache: the final latent and the denoised prediction of every step."""
    x0s = []
    out = sample(unet, **run_a_kwargs(), callback=lambda step, x0, x, total: x0s.append(x0.clone()))
    return out, x0s


def last_run_report(pack) -> dict:
    events = pack.accel.telemetry.snapshot()["events"]
    runs_ = [e for e in events if e["feature"] == "deepcache" and e["action"] == "run"]
    assert runs_, "no DeepCache run was reported"
    return runs_[-1]


def call_recorder(model, calls: list):
    """A clone whose outermost DIFFUSION_MODEL wrapper records each UNet call's cond_or_uncond (added before
    DeepCache, so it sees the shallow calls too)."""
    import comfy.patcher_extension as pe

    def record(executor, *args, **kwargs):
        calls.append(list(args[5]["cond_or_uncond"]))
        return executor(*args, **kwargs)

    clone = model.clone()
    clone.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_record_calls", record)
    return clone


# ---- the plan ---------------------------------------------------------------------------------------------

def test_uniform_and_nonuniform_plans(pack):
    schedule = pack.accel.deepcache.schedule
    sigmas = [float(20 - i) for i in range(21)]  # 20 steps at sigma 20..1, then the end point 0
    full = lambda plan: [i for i, f in enumerate(plan.full) if f]  # noqa: E731

    plan = schedule.make_plan(sigmas, 3, "uniform", 1e9, 0.0)
    assert full(plan) == [0, 3, 6, 9, 12, 15, 18] and plan.shallow_steps == 13
    assert plan.source(4) == 3 and plan.source(0) is None
    assert plan.cache_needed_after(18) and not plan.cache_needed_after(19)
    assert full(schedule.make_plan(sigmas, 1, "uniform", 1e9, 0.0)) == list(range(20))

    window = schedule.make_plan(sigmas, 3, "uniform", 15.0, 5.0)  # sigma in (5, 15]: steps 5..14
    assert full(window) == [0, 1, 2, 3, 4, 5, 8, 11, 14, 15, 16, 17, 18, 19]

    nonuniform = full(schedule.make_plan(sigmas, 3, "non-uniform", 1e9, 0.0))
    assert len(nonuniform) == 7 and nonuniform[0] == 0  # the same budget of full steps, the first one full
    gaps = [b - a for a, b in zip(nonuniform, nonuniform[1:])]
    near_center = [g for a, g in zip(nonuniform, gaps) if 3 <= a <= 8]  # 30 % of 20 steps is step 6
    assert near_center and max(near_center) < max(gaps), (nonuniform, gaps)

    assert plan.step_of(20.0, None) == 0 and plan.step_of(11.0, 3) == 9
    assert plan.step_of(12.5, 7) == 7  # a sampler's sub-step between two scheduled sigmas stays in its step
    # Custom sigmas that come back to a sigma (a restart schedule): each call is the next step with its sigma
    # (before, the first one: steps 3 and 4 were taken for 1 and 2, and reused four steps in a row).
    restart, steps = schedule.make_plan([14.6, 7.0, 3.0, 7.0, 3.0, 1.0, 0.0], 3, "uniform", 1e9, 0.0), [None]
    for sigma in (14.6, 7.0, 3.0, 7.0, 3.0, 1.0):
        steps.append(restart.step_of(sigma, steps[-1]))
    assert steps[1:] == [0, 1, 2, 3, 4, 5], steps


def test_adaptive_plan_keeps_the_ends_full_and_leaves_short_runs_alone(pack):
    schedule = pack.accel.deepcache.schedule
    sigmas = [float(20 - i) for i in range(21)]
    plan = schedule.make_plan(sigmas, 3, "adaptive", 1e9, 0.0)
    assert plan.adaptive and [i for i, f in enumerate(plan.full) if f] == [0, 19]  # the others decide in their step
    window = schedule.make_plan(sigmas, 3, "adaptive", 15.0, 5.0)  # sigma in (5, 15]: steps 5..14
    assert [i for i, f in enumerate(window.full) if not f] == list(range(6, 15))
    assert schedule.make_plan(sigmas, 1, "adaptive", 1e9, 0.0).shallow_steps == 0  # interval 1: never reuse
    short = [float(8 - i) for i in range(9)]  # 8 steps: distilled models' runs
    assert schedule.make_plan(short, 3, "adaptive", 1e9, 0.0).shallow_steps == 0
    assert schedule.make_plan(short, 3, "uniform", 1e9, 0.0).shallow_steps == 5  # the fixed plans do as set
    policy = pack.accel.deepcache.DeepCacheConfig(schedule="adaptive", interval=3, threshold=0.2).policy()
    assert policy.reuses(0.19, 1) and not policy.reuses(0.21, 0) and not policy.reuses(0.0, 2)
    with pytest.raises(ValueError, match="threshold"):
        pack.accel.deepcache.DeepCacheConfig(schedule="adaptive", threshold=-1.0)
    # A percent outside 0..1, or NaN (a prompt's JSON may hold one, and ComfyUI's range check lets it through):
    # refused with its name, as the threshold is, not a run that silently reuses nothing
    for name in ("start_percent", "end_percent"):
        for value in (float("nan"), 1.5):
            with pytest.raises(ValueError, match=f"{name} must be between 0 and 1"):
                pack.accel.deepcache.DeepCacheConfig(**{name: value})


def test_adaptive_mode_on_the_unet(pack, unet):
    """Threshold 0 equals no DeepCache bit for bit; the defaults reuse on some steps of a 12-step run and say how
    many; run A, then B (another size, batch 2, cond and uncond in separate calls), then A, then A after an
    unload: every A equal; A split equals A batched (every chunk of a step has the same input latent)."""
    import comfy.model_management

    def adaptive(model, threshold=None):
        extra = {} if threshold is None else {"threshold": threshold}
        return pack.nodes.deepcache.DeepCache().apply(model, 3, 1, 0.0, 1.0, "adaptive", **extra)[0]

    STEPS = 12  # adaptive mode leaves runs of 8 steps or fewer alone
    eager = sample(unet, size=(8, 8), steps=STEPS, seed=0)
    assert torch.equal(sample(adaptive(unet, 0.0), size=(8, 8), steps=STEPS, seed=0), eager)
    assert last_run_report(pack)["reused_steps"] == 0
    model = adaptive(unet)
    a1 = sample(model, size=(8, 8), steps=STEPS, seed=0)
    report = last_run_report(pack)
    assert report["schedule"] == "adaptive" and 0 < report["reused_steps"] < STEPS - 1, report
    assert report["shallow_calls"] == report["reused_steps"] and 0 < report["compute_skipped"] < 1, report
    assert not torch.equal(a1, eager)
    b = sample(split_cond_uncond(model), size=(8, 16), batch=2, steps=STEPS, seed=1)
    assert b.shape == (2, 4, 8, 16) and last_run_report(pack)["reused_steps"] > 0
    assert torch.equal(sample(model, size=(8, 8), steps=STEPS, seed=0), a1), "run A changed after run B"
    comfy.model_management.unload_all_models()
    assert torch.equal(sample(model, size=(8, 8), steps=STEPS, seed=0), a1), "run A changed after an unload"
    split = sample(split_cond_uncond(model), size=(8, 8), steps=STEPS, seed=0)
    assert last_run_report(pack)["reused_steps"] == report["reused_steps"]
    torch.testing.assert_close(split, a1, rtol=0, atol=1e-6 * a1.abs().max().item())


def test_percent_window_uses_the_models_sigmas(pack, unet):
    import comfy.samplers

    run_state = pack.accel.deepcache.run_state
    model_sampling = unet.get_model_object("model_sampling")
    sigmas = comfy.samplers.calculate_sigmas(model_sampling, "normal", 10)
    config = run_state.DeepCacheConfig(interval=2, start_percent=0.2, end_percent=0.8)
    plan = run_state.start_run(config, 0, sigmas, model_sampling).plan
    start, end = model_sampling.percent_to_sigma(0.2), model_sampling.percent_to_sigma(0.8)
    inside = [i for i, s in enumerate(sigmas[:-1].tolist()) if end < s <= start]
    assert 0 < inside[0] and inside[-1] < 9
    assert all(plan.full[i] for i in range(10) if i not in inside)
    assert [plan.full[i] for i in inside] == [k % 2 == 0 for k in range(len(inside))]


# ---- what it computes ---------------------------------------------------------------------------------------

def test_interval_1_gives_the_same_output_as_no_deepcache(pack, unet, eager):
    out = sample(deepcache(pack, unet, interval=1, depth=0), **run_a_kwargs())
    assert torch.equal(out, eager[0])
    report = last_run_report(pack)
    assert report["reused_steps"] == 0 and report["full_calls"] == RUN_A["steps"]


def test_reuses_deep_features_on_planned_steps_and_reports_it(pack, unet, eager, caplog):
    x0s = []
    with caplog.at_level(logging.INFO, logger="comfyui_accel"):
        out = sample(deepcache(pack, unet, interval=3, depth=1), **run_a_kwargs(),
                     callback=lambda step, x0, x, total: x0s.append(x0.clone()))
    # Step 0 is a full step: exactly ComfyUI's forward. Step 1 reuses step 0's deep features: not the same.
    assert torch.equal(x0s[0], eager[1][0])
    assert not torch.allclose(x0s[1], eager[1][1], atol=1e-4)
    assert torch.isfinite(out).all() and not torch.allclose(out, eager[0], atol=1e-4)

    report = last_run_report(pack)
    assert report["status"] == "completed" and report["steps"] == 6
    counts = (report["reused_steps"], report["shallow_calls"], report["full_calls"], report["fallback_calls"])
    assert counts == (4, 4, 2, 0)
    share = report["shallow_share"]
    assert 0.0 < share < 1.0
    assert report["compute_skipped"] == pytest.approx(4 / 6 * (1 - share), abs=1e-3)
    assert "deep features reused on 4 of 6 steps" in caplog.text


UNCOND, COND = uuid.uuid4(), uuid.uuid4()


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_shallow_path_equals_full_path_on_the_same_input(pack, unet, depth):
    """With the same input as the full step that cached the deep feature, the shallow path must give the full
    output: every skipped block, patch, control residual and transformer_index is accounted for. The model
    carries an input-block patch, an output-block patch that writes into h in place (as FreeU does) and
    ControlNet-style residuals for every block."""
    run_state = pack.accel.deepcache.run_state
    seen = {}

    def input_patch(h, transformer_options):
        return h * 1.01

    def output_patch(h, hsp, transformer_options):
        seen.setdefault(transformer_options["block"], []).append(transformer_options["transformer_index"])
        h[:, : h.shape[1] // 2] *= 1.1  # in place, like FreeU's backbone scaling
        return h, hsp * 0.9

    patched = unet.clone()
    patched.set_model_input_block_patch(input_patch)
    patched.set_model_output_block_patch(output_patch)
    model = deepcache(pack, patched, interval=2, depth=depth)
    gen = torch.Generator().manual_seed(depth)
    x = torch.randn(2, 4, 16, 16, generator=gen)
    t = torch.tensor([500.0, 500.0])
    context = torch.randn(2, 77, 768, generator=gen)

    # Control residuals: ComfyUI pops one per block, so the lists are in reverse block order.
    shapes = {}

    def record_shape(h, transformer_options):
        shapes[transformer_options["block"][1]] = h.shape
        return h

    probe = unet.clone()
    probe.set_model_input_block_patch(record_shape)
    unet_call(probe, None, 1.0, x, t, context)
    n = len(shapes)
    control_in = [torch.randn(shapes[i], generator=gen) * 0.1 for i in range(n)]

    def control():
        return {"input": control_in[::-1], "middle": [None], "output": control_in[:]}  # output block j gets skip n-1-j

    run = run_state.start_run(run_state.DeepCacheConfig(interval=2, depth=depth), depth,
                            torch.tensor([10.0, 5.0, 0.0]), model.get_model_object("model_sampling"))
    full = unet_call(model, run, 10.0, x, t, context, control())   # step 0: full, caches the deep feature
    shallow = unet_call(model, run, 5.0, x, t, context, control())  # step 1: shallow, on the same input
    again = unet_call(model, run, 5.0, x, t, context, control())    # the cached feature was not written into
    assert (run.full_calls, run.shallow_calls, run.fallback_calls) == (1, 2, 0)
    torch.testing.assert_close(shallow, full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(again, full, rtol=1e-4, atol=1e-5)
    for block in [("output", j) for j in range(n - 1 - depth, n)]:
        assert len(set(seen[block])) == 1, (block, seen[block])  # same transformer_index on both paths


def unet_call(model, run, sigma, x, t, context, control=None, chunks=((1, UNCOND), (0, COND))):
    """One UNet call as `_calc_cond_batch` makes it (by default uncond and cond batched), inside the run `run`:
    the transformer options a sampling run would pass, with the run state where the OUTER_SAMPLE wrapper puts it."""
    import comfy.patcher_extension as pe

    to = pe.copy_nested_dicts(model.model_options["transformer_options"])
    to["wrappers"] = {k: {kk: list(vv) for kk, vv in w.items()} for k, w in model.wrappers.items()}
    to.update(sigmas=torch.tensor([sigma]), cond_or_uncond=[c for c, _ in chunks], uuids=[u for _, u in chunks])
    if run is not None:
        to[sys.modules[type(run).__module__].RUN_KEY] = run  # the run_state module of the loaded pack
    with torch.no_grad():
        return model.model.diffusion_model(x, t, context=context, control=control, transformer_options=to)


def test_cached_features_are_matched_per_chunk_shape_and_step(pack, unet):
    """Within a run, a call reads only the features of its own cond chunks (by uuid, in its own order), of its
    shape, and from its step's source full step or later; anything else is a full step."""
    run_state = pack.accel.deepcache.run_state
    model = deepcache(pack, unet, interval=3, depth=1)
    run = run_state.start_run(run_state.DeepCacheConfig(interval=3, depth=1), 1, torch.tensor([10.0, 5.0, 2.0, 0.0]),
                            model.get_model_object("model_sampling"))  # steps: 0 full, 1 and 2 shallow
    gen = torch.Generator().manual_seed(7)
    x, context = torch.randn(2, 4, 16, 16, generator=gen), torch.randn(2, 77, 768, generator=gen)
    t = torch.tensor([400.0, 400.0])
    counts = lambda: (run.full_calls, run.shallow_calls, run.fallback_calls)  # noqa: E731

    unet_call(model, run, 5.0, x, t, context)  # step 1 with nothing cached yet: full, and it caches
    assert counts() == (1, 0, 1)
    both = unet_call(model, run, 2.0, x, t, context)  # step 2 reads step 1's features
    assert counts() == (1, 1, 1)
    cond_only = unet_call(model, run, 2.0, x[1:], t[1:], context[1:], chunks=((0, COND),))
    swapped = unet_call(model, run, 2.0, x.flip(0), t, context.flip(0), chunks=((0, COND), (1, UNCOND)))
    assert counts() == (1, 3, 1)
    torch.testing.assert_close(cond_only, both[1:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(swapped, both.flip(0), rtol=1e-4, atol=1e-5)

    unet_call(model, run, 2.0, x[1:], t[1:], context[1:], chunks=((0, uuid.uuid4()),))  # another sampler's cond
    unet_call(model, run, 2.0, torch.randn(2, 4, 8, 8), t, context)  # another resolution
    unet_call(model, run, 2.0, x.repeat(2, 1, 1, 1), t.repeat(2), context.repeat(2, 1, 1),
              chunks=((1, UNCOND), (0, COND)))  # another batch size per chunk
    assert counts() == (4, 3, 4)


def test_cond_uncond_split_matches_batched(pack, unet, eager):
    import comfy.model_management

    batched_calls, split_calls, memory_calls = [], [], []
    batched = sample(deepcache(pack, call_recorder(unet, batched_calls), 3, 1), **run_a_kwargs())
    split = sample(deepcache(pack, split_cond_uncond(call_recorder(unet, split_calls)), 3, 1), **run_a_kwargs())
    report = last_run_report(pack)
    assert batched_calls == [[1, 0]] * 6
    assert split_calls == [[1], [0]] * 6
    assert (report["reused_steps"], report["shallow_calls"], report["fallback_calls"]) == (4, 8, 0)
    assert not torch.allclose(split, eager[0], atol=1e-4)  # the cache was used
    torch.testing.assert_close(split, batched, rtol=0, atol=1e-4)

    # ComfyUI's own memory fallback splits the calls the same way and gives the same result.
    memory = call_recorder(unet, memory_calls)
    memory.add_object_patch("memory_usage_factor", 1e30)
    try:
        by_memory = sample(deepcache(pack, memory, 3, 1), **run_a_kwargs())
    finally:
        comfy.model_management.unload_all_models()  # the object patch stays on the shared model until unloaded
    assert memory_calls == [[1], [0]] * 6
    torch.testing.assert_close(by_memory, split, rtol=0, atol=1e-6)


# ---- no leaks, no mix-ups -------------------------------------------------------------------------------------

def test_no_state_leaks_between_runs(pack, unet, tmp_path):
    """Run A, then B (another size, batch 2, cond/uncond in separate calls), B again interrupted mid-run, then
    A again, then A after unloading the model: every A equals A computed in a fresh process."""
    import comfy.model_management

    fresh_file = tmp_path / "run_a.pt"
    fresh = subprocess.Popen([sys.executable, str(Path(runs.__file__)), str(fresh_file)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        a1 = runs.run_a(pack, unet)
        b_model = deepcache(pack, split_cond_uncond(unet), RUN_A["interval"], RUN_A["depth"])
        b = sample(b_model, size=(8, 16), batch=2, steps=6, seed=1)
        assert b.shape == (2, 4, 8, 16) and last_run_report(pack)["shallow_calls"] == 8

        def interrupt(step, x0, x, total):
            if step == 1:  # after a shallow step, with features cached
                raise comfy.model_management.InterruptProcessingException()

        with pytest.raises(comfy.model_management.InterruptProcessingException):
            sample(b_model, size=(8, 16), batch=2, steps=6, seed=1, callback=interrupt)
        assert last_run_report(pack)["status"] == "interrupted"
        a2 = runs.run_a(pack, unet)
        comfy.model_management.unload_all_models()
        a3 = runs.run_a(pack, unet)
        output, _ = fresh.communicate(timeout=600)
    finally:
        fresh.kill()
    assert fresh.returncode == 0, output[-3000:]
    a_fresh = torch.load(fresh_file)
    assert torch.equal(a1, a_fresh)
    assert torch.equal(a2, a_fresh)
    assert torch.equal(a3, a_fresh)


def test_second_sampler_in_the_same_workflow(pack, unet):
    """A hires-fix second pass (upscaled latent, denoise 0.5) gets its own plan and cache: it gives the same
    result after the first pass as on its own."""
    model = deepcache(pack, unet, 3, 1)
    latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3))  # a first pass's upscaled output
    alone = sample(model, latent=latent, steps=6, seed=4, denoise=0.5)
    first = sample(model, size=(8, 8), steps=6, seed=3)
    assert first.shape == (1, 4, 8, 8)
    after_first = sample(model, latent=latent, steps=6, seed=4, denoise=0.5)
    report = last_run_report(pack)
    assert report["steps"] == 6 and report["reused_steps"] == 4 and report["fallback_calls"] == 0
    assert torch.equal(after_first, alone)


def test_sampler_with_sub_steps(pack, unet):
    """heun evaluates the model twice per step, once at a sigma of the next step: no fallback, no error."""
    out = sample(deepcache(pack, unet, 3, 0), size=(8, 8), steps=4, sampler="heun")
    report = last_run_report(pack)
    assert torch.isfinite(out).all()
    assert report["reused_steps"] == 2 and report["fallback_calls"] == 0


def test_a_guidance_nodes_own_call_in_a_step_runs_in_full(pack, unet):
    """PerturbedAttentionGuidance (ComfyUI's node) calls the UNet a second time in each step for the cond, with
    its own self-attention in the middle block, inside the part DeepCache reuses. That call is not the cond's:
    before, on full steps it stored its perturbed features over the cond's, and on reused steps it was served the
    cond's, so its prediction came out as the cond's and PAG's guidance vanished there. Now it runs in full in
    every step (each output equal to the same call without DeepCache), while the sampler's calls still reuse."""
    import comfy.patcher_extension as pe
    from comfy_extras.nodes_pag import PerturbedAttentionGuidance

    calls = []

    def record(executor, *args, **kwargs):
        out = executor(*args, **kwargs)
        options = args[5]
        if "attn1" in options.get("patches_replace", {}):  # PAG's own call: its perturbed attention
            kept = {k: v for k, v in options.items() if k != "wrappers" and not k.startswith("accel_")}
            calls.append(([a.clone() if isinstance(a, torch.Tensor) else a for a in args[:5]], kept, out.clone()))
        return out

    recorded = PerturbedAttentionGuidance.execute(unet, 3.0).result[0].clone()
    recorded.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_record_pag", record)  # outside DeepCache's
    sample(deepcache(pack, recorded, RUN_A["interval"], RUN_A["depth"]), **run_a_kwargs())
    report = last_run_report(pack)
    assert report["reused_steps"] == 4 and report["shallow_calls"] == 4, report  # the sampler's calls
    assert len(calls) == RUN_A["steps"], len(calls)
    with torch.no_grad():
        for step, ((x, t, context, y, control), options, out) in enumerate(calls):
            alone = unet.model.diffusion_model(x, t, context=context, y=y, control=control,
                                               transformer_options=options)
            assert torch.equal(out, alone), f"step {step}: PAG's call was served or changed by DeepCache"


def test_each_context_window_reuses_its_own_features(pack, unet):
    """ComfyUI's context windows (ContextWindowsManual) call the model once per window with the same conds, uuids
    and all: before, the last window's features were stored over the others' and every window reused them. Now
    each window reads its own: over a latent's 16 rows in windows of 8 (no overlap; ComfyUI's windows are for a
    video's frames, and take a batch of 1), each window comes out as DeepCache gives it run on its rows alone."""
    import comfy.sample
    from comfy_extras.nodes_context_windows import ContextWindowsManualNode

    settings = dict(context_length=8, context_overlap=0, context_schedule="standard_static", context_stride=1,
                    closed_loop=False, fuse_method="pyramid", dim=2)
    if "freenoise" in inspect.signature(ContextWindowsManualNode.execute).parameters:  # ComfyUI 0.33
        # no anchor row from the window before (on by default there): each window is its rows alone
        settings.update(freenoise=False, causal_window_fix=False)
    windowed = ContextWindowsManualNode.execute(unet, **settings).result[0]
    noise = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(5))
    pos, neg = runs.conds(0)

    def run(model, noise_):
        latent = torch.zeros_like(noise_)
        return comfy.sample.sample(model, noise_, RUN_A["steps"], 5.0, "euler", "normal", pos, neg, latent,
                                   disable_pbar=True, seed=0)

    together = run(deepcache(pack, windowed, RUN_A["interval"], RUN_A["depth"]), noise)
    report = last_run_report(pack)
    assert report["reused_steps"] == 4 and report["fallback_calls"] == 0, report
    for rows in (slice(0, 8), slice(8, 16)):
        alone = run(deepcache(pack, unet, RUN_A["interval"], RUN_A["depth"]), noise[:, :, rows])
        torch.testing.assert_close(together[:, :, rows], alone, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, r=rows: f"rows {r.start}-{r.stop - 1}: {m}")


def test_area_conds_taking_turns_never_read_each_others_features(pack, unet):
    """Regional prompting: two areas of one size, each for half of the steps (ConditioningSetArea and
    ConditioningSetTimestepRange), at cfg 5. ComfyUI copies each positive area cond into the negative under its
    own uuid, so each area's calls hold one uuid twice: before, their chunks were keyed by the cond/uncond index
    alone, the same for both areas, and the second area's first reused steps read the first area's features.
    Now the second area's first call finds no features of its own and runs in full (the run's one fallback)."""
    import comfy.sample
    import nodes

    pos, neg = runs.conds(0)
    gen = torch.Generator().manual_seed(5)
    first, second = ([[torch.randn(1, 77, 768, generator=gen), {}]] for _ in range(2))
    first = nodes.ConditioningSetArea().append(first, 64, 64, 0, 0, 1.0)[0]
    second = nodes.ConditioningSetArea().append(second, 64, 64, 64, 64, 1.0)[0]
    positive = (pos + nodes.ConditioningSetTimestepRange().set_range(first, 0.0, 0.5)[0]
                + nodes.ConditioningSetTimestepRange().set_range(second, 0.5, 1.0)[0])
    latent = torch.zeros(1, 4, 16, 16)
    out = comfy.sample.sample(deepcache(pack, unet, 3, 1), comfy.sample.prepare_noise(latent, 0), 8, 5.0, "euler",
                              "normal", positive, neg, latent, disable_pbar=True, seed=0)
    report = last_run_report(pack)
    assert torch.isfinite(out).all()
    assert report["fallback_calls"] == 1 and report["reused_steps"] == 5, report


def test_nonuniform_schedule_run(pack, unet):
    """The non-uniform schedule keeps the uniform one's budget of full steps (2 of 6 at interval 3: steps 0 and
    3 uniform, 0 and 5 non-uniform) and places them differently, so the output differs."""
    uniform = sample(deepcache(pack, unet, 3, 0), size=(8, 8), steps=6)
    nonuniform = sample(deepcache(pack, unet, 3, 0, schedule="non-uniform"), size=(8, 8), steps=6)
    report = last_run_report(pack)
    assert report["schedule"] == "non-uniform" and report["reused_steps"] == 4 and report["fallback_calls"] == 0
    assert torch.isfinite(nonuniform).all() and not torch.equal(uniform, nonuniform)


# ---- models it cannot serve, options it cannot honour -------------------------------------------------------------

def test_a_model_deepcache_does_not_know_passes_through_with_a_message(pack, comfy_dir, caplog):
    """Lumina 2's NextDiT takes no per-block replace patches in its loop (transformers that do: test_deepcache_dit.py)."""
    import comfy.model_patcher

    from tools import family_models

    lumina = family_models.BY_NAME["lumina2"]  # on the meta device: shapes only, no memory
    model = comfy.model_patcher.ModelPatcher(family_models.build_model(lumina.detected, lumina.unet_config),
                                             torch.device("cpu"), torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="comfyui_accel"):
        out = deepcache(pack, model, 3, 0)
    assert out is not model and out.model is model.model
    assert not any("accel_deepcache" in w for kind in out.wrappers.values() for w in kind)
    event = [e for e in pack.accel.telemetry.snapshot()["events"] if e["feature"] == "deepcache"][-1]
    assert (event["feature"], event["action"]) == ("deepcache", "unsupported") and "NextDiT" in event["reason"]
    assert "NextDiT is neither a ComfyUI UNetModel nor a transformer DeepCache knows" in caplog.text
    assert "passes through unchanged" in caplog.text


def test_cache_depth_beyond_the_unet_uses_its_deepest_branch(pack, unet, caplog):
    with caplog.at_level(logging.INFO, logger="comfyui_accel"):
        model = deepcache(pack, unet, 3, 12)
    event = [e for e in pack.accel.telemetry.snapshot()["events"] if e["feature"] == "deepcache"][-1]
    assert event["action"] == "applied" and event["depth"] == 3  # the small UNet has 4 input blocks
    assert "beyond this UNet's deepest branch 3" in caplog.text
    assert model is not unet and not unet.wrappers.get("diffusion_model")  # the input model is untouched


# ---- with Compile Model ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["compile_then_deepcache", "deepcache_then_compile"])
def test_with_compile_model_no_recompiles_after_the_first_run(pack, unet, order):
    """Compile Model compiles the UNet's blocks from an APPLY_MODEL wrapper; DeepCache calls those blocks from
    its DIFFUSION_MODEL wrapper with the full/shallow decision made outside them. After a first run has
    compiled the full and the shallow path, further runs (another seed, same shapes) compile nothing.
    Compiles are counted with Dynamo's own counter, as a change over what this test does."""
    from torch._dynamo.utils import counters

    compile_node = pack.nodes.compile_model.CompileModel()

    def compiled(model):  # "always compiled": never the timed choice of eager, so both paths really run compiled
        return compile_node.apply(model, "default", "static", "auto", "always compiled")[0]

    def build():
        if order == "compile_then_deepcache":
            return deepcache(pack, compiled(unet), 3, 1)
        return compiled(deepcache(pack, unet, 3, 1))

    eager_deepcache = sample(deepcache(pack, unet, 3, 1), **run_a_kwargs())
    model = build()
    first = sample(model, **run_a_kwargs())  # compiles what this process has not compiled yet (kinds are shared)
    report = last_run_report(pack)
    assert (report["reused_steps"], report["shallow_calls"]) == (4, 4)
    torch.testing.assert_close(first, eager_deepcache, rtol=1e-3, atol=1e-3)
    after_first = counters["frames"]["ok"]
    registry = pack.accel.compile.REGISTRY

    def served():  # block calls answered by compiled code, and block calls that ran eagerly
        kinds = registry.stats()["kinds"]
        return sum(k["cache_hits"] for k in kinds), sum(sum(k["eager_calls"].values()) for k in kinds)

    hits, eager_calls = served()
    with torch.compiler.set_stance("fail_on_recompile"):
        second = sample(model, **{**run_a_kwargs(), "seed": 5})
        sample(build(), **run_a_kwargs())  # a new clone of the same nodes: still nothing to compile
    assert counters["frames"]["ok"] == after_first, "DeepCache made Compile Model recompile after the first run"
    assert served()[0] > hits and served()[1] == eager_calls, "the blocks did not run compiled on every path"
    assert torch.isfinite(second).all()

    # The adaptive schedule, in the same order: its decision is plain Python before each UNet call, and its full
    # and shallow paths call the blocks compiled above; nothing compiles.
    def adaptive(m):
        return pack.nodes.deepcache.DeepCache().apply(m, 3, 1, 0.0, 1.0, "adaptive", 0.3)[0]

    adaptive_model = adaptive(compiled(unet)) if order == "compile_then_deepcache" else compiled(adaptive(unet))
    with torch.compiler.set_stance("fail_on_recompile"):
        out = sample(adaptive_model, size=RUN_A["size"], steps=12, seed=0)
    assert last_run_report(pack)["reused_steps"] > 0 and torch.isfinite(out).all()
    assert counters["frames"]["ok"] == after_first, "the adaptive schedule made Compile Model compile"


def test_forecast_on_the_unet_extrapolates_later_reused_steps_and_leaks_nothing(pack, unet, eager):
    """forecast "linear" on the UNet's deep feature: the steps with two full steps behind them (interval 3 over 6
    steps: 4 and 5) get the line through both, the earlier ones the feature as it is, so the output differs from
    plain reuse; interval 1 changes nothing; run A, then B at another size with cond and uncond split, then A
    again: bit for bit the same. live_blocks, a transformer's option, is named in the log and changes nothing. With
    a sampler that calls the model twice a step (heun), the line is drawn too."""
    node = pack.nodes.deepcache.DeepCache()

    def apply(interval=3, **options):
        return node.apply(unet, interval, 0, 0.0, 1.0, "uniform", **options)[0]

    assert torch.equal(sample(apply(1, forecast="linear"), **run_a_kwargs()), eager[0])
    plain = sample(apply(), **run_a_kwargs())
    forecast = apply(forecast="linear")
    first = sample(forecast, **run_a_kwargs())
    report = last_run_report(pack)
    assert report["forecast"] == "linear" and report["reused_steps"] == 4 and report["live_blocks"] is None, report
    assert torch.isfinite(first).all() and not torch.equal(first, plain), "nothing was extrapolated"
    sample(split_cond_uncond(forecast), size=(8, 16), batch=2, steps=6, seed=1)
    assert torch.equal(sample(forecast, **run_a_kwargs()), first), "run A changed after run B"
    assert torch.equal(sample(apply(live_blocks="first only"), **run_a_kwargs()), plain)
    # heun calls the model twice a step: the second full call of a step keeps the step before as the line's
    # other end (before, it dropped it, and "linear" gave plain reuse's output bit for bit)
    heun = {**run_a_kwargs(), "steps": 9, "sampler": "heun"}
    assert not torch.equal(sample(forecast, **heun), sample(apply(), **heun)), "heun: nothing was extrapolated"


def test_fitted_forecast_on_the_unet_extrapolates_and_leaks_nothing(pack, unet):
    """forecast "fitted" on the UNet (adaptive; the signal is the input latent): the reused steps extrapolate, so
    the output differs from plain reuse; run A, then B at another size with cond and uncond split, then A again:
    bit for bit the same."""
    def apply(forecast):
        return pack.nodes.deepcache.DeepCache().apply(unet, 6, 0, 0.0, 1.0, "adaptive", 0.5, forecast=forecast)[0]

    fitted = apply("fitted")
    first = sample(fitted, size=RUN_A["size"], steps=12, seed=0)
    report = last_run_report(pack)
    assert report["forecast"] == "fitted" and report["reused_steps"] > 2, report
    assert torch.isfinite(first).all()
    assert not torch.equal(first, sample(apply("off"), size=RUN_A["size"], steps=12, seed=0)), "nothing extrapolated"
    sample(split_cond_uncond(fitted), size=(8, 16), batch=2, steps=12, seed=1)
    assert torch.equal(sample(fitted, size=RUN_A["size"], steps=12, seed=0), first), "run A changed after run B"


def test_the_quadratic_forecast_is_exact_on_a_parabola_in_sigma(pack):
    """forecast "quadratic" (TaylorSeer's order 2, run_state.py): a reused step gets the parabola in sigma through
    the last three full steps' features, so on features that are a parabola of sigma it is exact where "linear"
    (the line through the last two) is not; a step with only two full steps behind it gets the line. Entries kept
    per chunk: the last full step's, the one before, the one before that; a full call frees the oldest first."""
    run_state, config = pack.accel.deepcache.run_state, pack.accel.deepcache.config
    sigmas = [14.6, 8.0, 4.5, 2.6, 1.5, 0.9, 0.5, 0.3, 0.0]
    coefficients = torch.tensor([[0.3, -1.2], [2.0, 0.5]]), torch.tensor([[0.7, 0.1], [-0.4, 1.1]])

    def feature(sigma: float) -> torch.Tensor:  # a + b s + c s^2, per element
        return 1.5 + coefficients[0] * sigma + coefficients[1] * sigma * sigma

    def state(forecast: str):
        cfg = config.DeepCacheConfig(interval=3, forecast=forecast)
        plan = pack.accel.deepcache.schedule.make_plan(sigmas, 3, "uniform", sigmas[0], 0.0)
        run = run_state.RunState(config=cfg, depth=0, plan=plan)
        key, signature = ("uuids", "a"), (1, (2, 2), torch.float32, torch.device("cpu"))
        for step in (0, 3, 6):  # the full steps of interval 3
            run.drop_unread([key])
            run.store([key], step, signature, feature(sigmas[step]).unsqueeze(0))
        return run, run.features[key]

    quadratic, entry = state("quadratic")
    assert [entry.step, entry.previous.step, entry.previous.previous.step] == [6, 3, 0]
    assert entry.previous.previous.previous is None
    exact = feature(sigmas[7]).unsqueeze(0)
    assert torch.allclose(quadratic.reused_feature(entry, 7), exact, rtol=1e-5, atol=1e-5)
    linear, linear_entry = state("linear")
    assert linear_entry.previous.previous is None  # the line keeps one entry before
    assert not torch.allclose(linear.reused_feature(linear_entry, 7), exact, rtol=1e-3, atol=1e-3)
    # two full steps behind (step 4, after full steps 0 and 3): the line, as "linear" gives
    two, entry_two = state("quadratic")
    entry_two.previous.previous = None
    line, line_entry = state("linear")
    assert torch.equal(two.reused_feature(entry_two, 7), line.reused_feature(line_entry, 7))


def test_the_nodes_default_schedule_is_auto_the_unets_preset(pack, unet):
    """The node's default schedule, auto, takes the UNet preset (accel/deepcache/presets.py) whatever the node's
    own interval, threshold and forecast say: its output is the preset's setting given by hand, bit for bit, and
    its report names the preset. A run of 8 steps or fewer (few-step models) reuses nothing, equals full compute,
    and its report and status line say so."""
    preset = pack.accel.deepcache.presets.PRESETS["UNet"]
    node = pack.nodes.deepcache.DeepCache()
    schedule = node.INPUT_TYPES()["required"]["schedule"]
    assert schedule[1]["default"] == "auto" and schedule[0][0] == "auto"
    auto = node.apply(unet, 2, 1, 0.0, 1.0, "auto", threshold=0.01, forecast="off")[0]
    by_hand = node.apply(unet, preset.interval, 1, 0.0, 1.0, "adaptive", threshold=preset.threshold,
                         forecast=preset.forecast)[0]
    out = sample(auto, size=(8, 8), steps=12, seed=0)
    report = last_run_report(pack)
    assert report["preset"] == "UNet" and report["schedule"] == "adaptive", report
    assert (report["interval"], report["threshold"], report["forecast"]) == (
        preset.interval, preset.threshold, preset.forecast) and report["reused_steps"] > 0, report
    assert "auto: the UNet preset" in pack.nodes.status.deepcache_run_text(report)
    assert torch.equal(out, sample(by_hand, size=(8, 8), steps=12, seed=0))
    assert last_run_report(pack)["preset"] is None
    few = sample(auto, size=(8, 8), steps=4, seed=0)
    report = last_run_report(pack)
    assert torch.equal(few, sample(unet, size=(8, 8), steps=4, seed=0)), "a 4-step run changed"
    assert report["few_steps"] and report["reused_steps"] == 0, report
    assert "under 9: the adaptive schedule reuses nothing on few-step" in pack.nodes.status.deepcache_run_text(report)
