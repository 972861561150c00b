"""DeepCache on transformer models (accel/deepcache/dit_paths.py): on a reused step the middle blocks' cached
residual replaces their work, and only the first and last blocks run.

HunyuanVideo (double- and single-stream lists) is the project's generated file through ComfyUI's UNETLoader; SD3
and Wan 2.1 are the same generated families with 4 blocks instead of 2 (a middle to skip), loaded from their state
dicts by ComfyUI's own diffusion-model loader (detection picks the family's class); Flux and Qwen-Image are built
from ComfyUI's own classes at two heads of 128 (NARROW: the generated files are 3072 wide, as detection pins them,
and Qwen-Image's has one block). Sampling is ComfyUI's own, with conditioning tensors of the family's widths, at
cfg 2 so that cond and uncond both run. Not covered here: Chroma (one block per list), LTX-Video (2 blocks).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tools import families
from deepcache_runs import deepcache, split_cond_uncond
from tools import family_models

CFG = 2.0  # cond and uncond: two chunks per call
STEPS = 6  # interval 3 reuses steps 1, 2, 4 and 5
REUSED = STEPS - math.ceil(STEPS / 3)  # all steps but one in three, from the first


def deeper(name: str, **config) -> family_models.Family:
    base = family_models.BY_NAME[name]
    return dataclasses.replace(base, unet_config={**base.unet_config, **config})


DEEPER = {
    "sd3": deeper("sd3", depth=4, context_embedder_config={
        "target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 256}}),
    "wan21": deeper("wan21", num_layers=4),
}
# Flux and Qwen-Image as their own ComfyUI classes (comfy.supported_models) at two 128-wide heads instead of the
# 24 that detection pins: 3 blocks per list for a middle to skip, megabytes instead of gigabytes. Built without
# the loader's detection, which would read them as 3072 wide (the loader's path is the generated files').
NARROW = {
    "flux": deeper("flux", hidden_size=256, num_heads=2, depth=3, depth_single_blocks=3),
    "qwen_image": deeper("qwen_image", num_layers=4, num_attention_heads=2),
}


def narrow_model(family: family_models.Family, seed: int = 7):
    """A ModelPatcher of the family's class and config, as ComfyUI's loader builds one, with seeded weights."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = family_models.config_for_this_comfyui(dict(family.unet_config))
    config = getattr(comfy.supported_models, family.detected)(unet_config)
    config.set_inference_dtype(torch.float32, None)
    weights = family_models.fill_family(config.get_model({}, device="meta").diffusion_model, seed)
    model = config.get_model({}, device="cpu")
    model.diffusion_model.load_state_dict(weights)
    return comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                            offload_device=comfy.model_management.unet_offload_device())


CASES = ("flux", "qwen_image", "hunyuan_video", "sd3", "wan21")


@pytest.fixture(scope="module")
def models(comfy_nodes):
    """Each family's model, loaded at its first test."""
    import comfy.sd

    class Loaded(dict):
        def __missing__(self, name):
            if name in DEEPER:
                state_dict = family_models.family_state_dict(DEEPER[name], seed=7)
                self[name] = comfy.sd.load_diffusion_model_state_dict(state_dict)
            elif name in NARROW:
                self[name] = narrow_model(NARROW[name])
            else:
                self[name] = families.load(comfy_nodes, families.BY_FAMILY[name])
            return self[name]

    return Loaded()


def run(model, name: str, seed: int = 0, latent_shape=None):
    family = families.BY_FAMILY[name]
    return families.sample(model, family, steps=STEPS, seed=seed, cfg=CFG, latent_shape=latent_shape)


def last_report(pack) -> dict:
    return next(e for e in reversed(pack.accel.telemetry.snapshot()["events"])
                if (e["feature"], e["action"]) == ("deepcache", "run"))


def bigger(name: str) -> tuple[int, ...]:
    """The family's latent at twice the batch and 8 more latent pixels a side: another shape entirely."""
    shape = list(families.BY_FAMILY[name].latent_shape)
    shape[0] *= 2
    shape[-1] += 8
    shape[-2] += 8
    return tuple(shape)


@pytest.mark.parametrize("name", CASES)
def test_dit_deepcache_reuses_the_middle_blocks_and_interval_1_changes_nothing(accel_pack, models, name):
    model = models[name]
    eager = run(model, name)
    assert torch.equal(run(deepcache(accel_pack, model, 1, 0), name), eager), "interval 1 changed the output"
    cached = run(deepcache(accel_pack, model, 3, 0), name)
    report = last_report(accel_pack)
    assert report["status"] == "completed" and report["reused_steps"] == REUSED, report
    assert report["shallow_calls"] == REUSED and report["fallback_calls"] == 0, report
    assert 0 < report["compute_skipped"] < 1 and 0 < report["shallow_share"] < 1, report
    assert torch.isfinite(cached).all() and not torch.equal(cached, eager), "nothing was reused"
    error = ((cached - eager).abs().max() / eager.abs().max()).item()
    assert error < 1.0, f"{name}: the reused residuals gave another picture entirely ({error:.3f})"


@pytest.mark.parametrize("name", CASES)
def test_dit_deepcache_leaks_nothing_between_runs(accel_pack, models, name):
    """Run A, then B at another size and batch with cond and uncond in separate calls, then A again: the second
    A equals the first bit for bit (every residual lives in its run only)."""
    model = deepcache(accel_pack, models[name], 3, 0)
    first = run(model, name, seed=3)
    other = run(split_cond_uncond(model), name, seed=4, latent_shape=bigger(name))
    report = last_report(accel_pack)
    assert report["reused_steps"] == REUSED and report["shallow_calls"] == 2 * REUSED, report
    assert torch.isfinite(other).all()
    assert torch.equal(run(model, name, seed=3), first), "run A changed after run B"


def louder(args, extra):
    """Another node's replace patch of a block (PuLID-style): the block's image tokens, 5 % louder."""
    out = extra["original_block"](args)
    return {**out, "img": out["img"] * 1.05}


def test_another_nodes_block_patch_keeps_working_under_deepcache(accel_pack, models):
    """A PuLID-style replace patch on a block of DeepCache's span still runs on full steps (DeepCache chains
    it instead of replacing it): with interval 1 the output equals the patched model's alone. Put on after
    DeepCache, it replaces the span block's own patch: a reused call would run that block on top of the
    residual, which holds its work already (before, the output was off by as much as DeepCache's own error), so
    every call runs in full and the output equals the patched model's alone."""
    name, model = "wan21", models["wan21"]

    patched = model.clone()
    patched.set_model_patch_replace(louder, "dit", "double_block", 1)
    alone = run(patched, name)
    assert not torch.equal(alone, run(model, name)), "the patch changed nothing"
    assert torch.equal(run(deepcache(accel_pack, patched, 1, 0), name), alone)
    # live_blocks "first only": the span is blocks 1 to 3 of 4, and block 2 is inside it (on a reused call the
    # span's first block adds the residual and its last one is skipped)
    inside = model.clone()
    inside.set_model_patch_replace(louder, "dit", "double_block", 2)
    after = with_options(accel_pack, model, live_blocks="first only").clone()
    after.set_model_patch_replace(louder, "dit", "double_block", 2)
    assert torch.equal(run(after, name), run(inside, name))
    report = last_report(accel_pack)
    assert report["reused_steps"] == 0, report
    (reason, calls), = report["ran_full"].items()  # the pass-through, named with the other node's patch
    assert "replaced the patch of double_block 2" in reason and "louder" in reason and calls > 0, report


@pytest.mark.parametrize("name", ("flux", "wan21"))
def test_quadratic_forecast_extrapolates_where_three_full_steps_are_behind_and_leaks_nothing(accel_pack, models,
                                                                                            name):
    """forecast "quadratic" on a transformer's residuals, interval 2 over 6 steps (full 0, 2, 4): step 5 has three
    full steps behind it and gets the parabola, so the output differs from "linear"; interval 1 changes nothing;
    run A, then B at another size with cond and uncond split, then A again: bit for bit the same."""
    model = models[name]
    assert torch.equal(run(with_options(accel_pack, model, 1, forecast="quadratic"), name), run(model, name))
    quadratic = with_options(accel_pack, model, 2, forecast="quadratic")
    first = run(quadratic, name, seed=3)
    assert last_report(accel_pack)["forecast"] == "quadratic" and last_report(accel_pack)["reused_steps"] == 3
    assert torch.isfinite(first).all()
    assert not torch.equal(first, run(with_options(accel_pack, model, 2, forecast="linear"), name, seed=3))
    run(split_cond_uncond(quadratic), name, seed=4, latent_shape=bigger(name))
    assert torch.equal(run(quadratic, name, seed=3), first), "run A changed after run B"


@pytest.mark.parametrize("name", ("flux", "wan21"))
def test_deepcache_applied_again_replaces_the_first_one_on_every_block(accel_pack, models, name):
    """A second DeepCache node on a DeepCache'd model replaces the first, also on the blocks only the first one's
    span covered: before, live_blocks "first only" then "first and last" left the first node's patches on the last
    blocks, which then read the second's decision by span index (blocks meant to run skipped). The output equals
    the second node's alone."""
    model = models[name]
    again = with_options(accel_pack, with_options(accel_pack, model, live_blocks="first only"),
                         live_blocks="first and last")
    assert torch.equal(run(again, name), run(with_options(accel_pack, model, live_blocks="first and last"), name))
    assert last_report(accel_pack)["reused_steps"] == REUSED


def test_a_patch_run_after_every_block_makes_each_call_run_in_full(accel_pack, models):
    """A "double_block" patch (Qwen-Image's DiffSynth ControlNet) runs after every block in ComfyUI's loop, inside
    DeepCache's span too: a reused residual holds what it added, and the loop would add it again. Such calls run
    in full, as with a ControlNet: the output equals the patched model's without DeepCache."""
    name, model = "qwen_image", models["qwen_image"]

    def nudge(args):
        return {"img": args["img"] + 0.05 * (args["block_index"] + 1), "txt": args["txt"]}

    patched = model.clone()
    patched.set_model_patch(nudge, "double_block")
    alone = run(patched, name)
    assert not torch.equal(alone, run(model, name)), "the patch changed nothing"
    assert torch.equal(run(deepcache(accel_pack, patched, 3, 0), name), alone)
    report = last_report(accel_pack)
    assert report["reused_steps"] == 0 and "runs after every block" in next(iter(report["ran_full"])), report


def test_wan_vace_passes_through_with_the_reason(accel_pack, comfy_dir, caplog):
    """Wan VACE adds its hints after blocks in the loop itself (no patch to see per call): DeepCache is not
    applied, and says why."""
    family = dataclasses.replace(deeper("wan21", model_type="vace", vace_layers=2, vace_in_dim=96),
                                 detected="WAN21_Vace")
    model = narrow_model(family)
    assert model.model.diffusion_model.vace_blocks is not None
    with caplog.at_level("WARNING", logger="comfyui_accel"):
        out = deepcache(accel_pack, model, 3, 0)
    assert out.model is model.model and "VACE hints" in caplog.text and "passes through" in caplog.text


def test_too_few_blocks_pass_through_with_the_reason(accel_pack, comfy_nodes, caplog):
    model = families.load(comfy_nodes, families.BY_FAMILY["ltxv"])  # 2 blocks: no middle
    with caplog.at_level("WARNING", logger="comfyui_accel"):
        out = deepcache(accel_pack, model, 3, 0)
    assert out.model is model.model and "too few blocks" in caplog.text and "passes through" in caplog.text


# ---- adaptive mode (accel/deepcache/adaptive.py) ------------------------------------------------------------
ADAPTIVE_CASES = ("flux", "qwen_image", "sd3", "wan21")
ADAPTIVE_STEPS = 20  # adaptive mode leaves runs of 8 steps or fewer alone


def adaptive(pack, model, threshold=None, interval=3):
    node = pack.nodes.deepcache.DeepCache()
    extra = {} if threshold is None else {"threshold": threshold}
    return node.apply(model, interval, 0, 0.0, 1.0, "adaptive", **extra)[0]


def run_adaptive(model, name: str, seed: int = 0, steps: int = ADAPTIVE_STEPS, latent_shape=None):
    family = families.BY_FAMILY[name]
    return families.sample(model, family, steps=steps, seed=seed, cfg=CFG, latent_shape=latent_shape)


@pytest.mark.parametrize("name", ADAPTIVE_CASES)
def test_adaptive_mode_reuses_by_default_and_threshold_0_changes_nothing(accel_pack, models, name):
    model = models[name]
    eager = run_adaptive(model, name)
    off = adaptive(accel_pack, model, threshold=0.0)
    assert torch.equal(run_adaptive(off, name), eager), "adaptive mode at threshold 0 changed the output"
    assert last_report(accel_pack)["reused_steps"] == 0
    cached = run_adaptive(adaptive(accel_pack, model), name)  # every default: threshold 0.2, interval 3
    report = last_report(accel_pack)
    assert report["status"] == "completed" and report["schedule"] == "adaptive", report
    assert report["threshold"] == accel_pack.accel.deepcache.DEFAULT_THRESHOLD, report
    assert 0 < report["reused_steps"] < ADAPTIVE_STEPS - 1 and 0 < report["compute_skipped"] < 1, report
    assert torch.isfinite(cached).all() and not torch.equal(cached, eager), "nothing was reused"
    error = ((cached - eager).abs().max() / eager.abs().max()).item()
    assert error < 1.0, f"{name}: adaptive reuse gave another picture entirely ({error:.3f})"


def test_adaptive_mode_leaves_runs_of_8_steps_alone(accel_pack, models):
    """Few-step (distilled) runs: nothing reused however high the threshold, the output is full compute's."""
    model = models["wan21"]
    assert torch.equal(run_adaptive(adaptive(accel_pack, model, threshold=10.0), "wan21", steps=8),
                       run_adaptive(model, "wan21", steps=8))
    assert last_report(accel_pack)["reused_steps"] == 0


@pytest.mark.parametrize("name", ADAPTIVE_CASES)
def test_adaptive_mode_leaks_nothing_and_cond_uncond_split_equals_batched(accel_pack, models, name):
    """Run A, then B at another size and batch with cond and uncond in separate calls, then A again, and A after
    the model was unloaded: each A equals the first bit for bit. A with cond and uncond split equals A batched
    (each chunk decides for itself; a batched call where only some chunks reuse gives each what it gets alone)."""
    import comfy.model_management

    model, steps = adaptive(accel_pack, models[name], threshold=0.3), 10
    first = run_adaptive(model, name, seed=3, steps=steps)
    other = run_adaptive(split_cond_uncond(model), name, seed=4, steps=steps, latent_shape=bigger(name))
    assert torch.isfinite(other).all() and last_report(accel_pack)["reused_steps"] > 0
    assert torch.equal(run_adaptive(model, name, seed=3, steps=steps), first), "run A changed after run B"
    comfy.model_management.unload_all_models()
    assert torch.equal(run_adaptive(model, name, seed=3, steps=steps), first), "run A changed after an unload"
    split = run_adaptive(split_cond_uncond(model), name, seed=3, steps=steps)
    torch.testing.assert_close(split, first, rtol=0, atol=1e-5 * first.abs().max().item(),
                               msg=lambda m: f"{name}: split cond/uncond differs from batched: {m}")


def test_a_call_where_only_some_chunks_reuse_gives_each_what_it_gets_alone(accel_pack, models):
    """Cond and uncond decide apart (their signals differ); at a threshold between them a batched call reuses for
    one chunk and runs the other. Its result equals cond and uncond in calls of their own, where each call
    either reuses or runs."""
    name = "flux"
    partial = None
    for threshold in (0.2, 0.22, 0.24, 0.26, 0.18):  # between the chunks' signals on this model (seeded weights)
        batched = run_adaptive(adaptive(accel_pack, models[name], threshold=threshold), name, seed=3, steps=10)
        report = last_report(accel_pack)
        if report["partial_calls"]:
            partial = threshold
            break
    assert partial is not None, f"no threshold gave a call in which only some chunks reused: {report}"
    split = run_adaptive(split_cond_uncond(adaptive(accel_pack, models[name], threshold=partial)), name, seed=3,
                         steps=10)
    assert last_report(accel_pack)["partial_calls"] == 0  # one chunk per call: each call reuses or runs
    torch.testing.assert_close(split, batched, rtol=0, atol=1e-5 * batched.abs().max().item())


# Flux's double and single lists under both nodes compile the most here: the full tier runs them.
_WITH_COMPILE_IN_FULL = {"flux": pytest.mark.full(why=(
    "DeepCache with Compile Model on Flux; make test runs it on Qwen-Image, SD3 and Wan 2.1 here, and Flux's "
    "DeepCache (adaptive, forecast) and its compiled blocks (test_compile_flux.py) each alone"))}


@pytest.mark.parametrize("name", [pytest.param(n, marks=_WITH_COMPILE_IN_FULL.get(n, ())) for n in ADAPTIVE_CASES])
def test_dit_deepcache_with_compile_model_recompiles_nothing_after_the_first_run(accel_pack, models, name):
    """Compile Model's compiled blocks serve DeepCache's full steps and the live blocks of its reused ones, in
    either node order, with the uniform schedule and the adaptive one (its decision is plain Python in the block
    loop, between compiled blocks); after the first run nothing compiles again (Dynamo's own counter)."""
    from torch._dynamo.utils import counters

    model = models[name]
    compile_node = accel_pack.nodes.compile_model.CompileModel()

    def compiled(m):
        return compile_node.apply(m, "default", "auto", "auto", "always compiled")[0]

    uniform = (lambda m: deepcache(accel_pack, m, 3, 0), lambda m, seed=0: run(m, name, seed=seed))
    adaptive_mode = (lambda m: adaptive(accel_pack, m, threshold=0.3),
                     lambda m, seed=0: run_adaptive(m, name, seed=seed, steps=10))
    for cache, sample_run in (uniform, adaptive_mode):
        reference = sample_run(cache(model))
        reused = last_report(accel_pack)["reused_steps"]
        assert reused > 0
        for build in (lambda: cache(compiled(model)), lambda: compiled(cache(model))):
            out = sample_run(build())
            assert last_report(accel_pack)["reused_steps"] == reused
            torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)
            frames = counters["frames"]["ok"]
            with torch.compiler.set_stance("fail_on_recompile"):
                sample_run(build(), seed=5)
            assert counters["frames"]["ok"] == frames, "DeepCache made Compile Model recompile after the first run"


# ---- forecast and live blocks (accel/deepcache/config.py) -----------------------------------------------------
def with_options(pack, model, interval=3, schedule="uniform", **options):
    return pack.nodes.deepcache.DeepCache().apply(model, interval, 0, 0.0, 1.0, schedule, **options)[0]


@pytest.mark.parametrize("name", CASES)
def test_first_only_skips_the_last_blocks_too_and_forecast_extrapolates_without_leaking(accel_pack, models, name):
    """live_blocks "first only" reuses the last blocks too: more compute skipped on the same steps. forecast
    "linear" changes the steps that have two full steps behind them (interval 3: 4 and 5) and nothing with
    interval 1; run A, then B at another size with cond and uncond split, then A again: bit for bit the same.
    Flux's and HunyuanVideo's two block lists each get a span, the single blocks' to their end."""
    model = models[name]
    eager = run(model, name)
    fast = {"forecast": "linear", "live_blocks": "first only"}
    assert torch.equal(run(with_options(accel_pack, model, 1, **fast), name), eager), "interval 1 changed the output"
    plain = run(with_options(accel_pack, model), name)
    both_ends = last_report(accel_pack)
    first_only = run(with_options(accel_pack, model, live_blocks="first only"), name)
    report = last_report(accel_pack)
    assert report["live_blocks"] == "first only" and report["reused_steps"] == both_ends["reused_steps"] == REUSED
    assert report["compute_skipped"] > both_ends["compute_skipped"], (report, both_ends)
    assert not torch.equal(first_only, plain), "the last blocks still ran"
    forecast = with_options(accel_pack, model, forecast="linear")
    first = run(forecast, name, seed=3)
    assert last_report(accel_pack)["forecast"] == "linear"
    assert not torch.equal(first, run(with_options(accel_pack, model), name, seed=3)), "nothing was extrapolated"
    assert torch.isfinite(first).all()
    run(split_cond_uncond(forecast), name, seed=4, latent_shape=bigger(name))
    assert torch.equal(run(forecast, name, seed=3), first), "run A changed after run B"
    error = ((run(with_options(accel_pack, model, **fast), name) - eager).abs().max() / eager.abs().max()).item()
    assert error < 1.0, f"{name}: forecast over the first block's span gave another picture entirely ({error:.3f})"


@pytest.mark.parametrize("name", ("flux", "wan21"))
def test_fitted_forecast_follows_the_signal_and_leaks_nothing(accel_pack, models, name):
    """forecast "fitted" (adaptive): the reused steps get their residuals along the line of the last two full
    steps, as far as the signal measured at that step moved along its own last change; the output differs from
    plain reuse and from "linear"; run A, then B at another size with cond and uncond split, then A again: bit
    for bit the same."""
    model = models[name]
    fitted = with_options(accel_pack, model, 6, "adaptive", threshold=0.5, forecast="fitted",
                          live_blocks="first only")
    first = run_adaptive(fitted, name, seed=3)
    report = last_report(accel_pack)
    assert report["forecast"] == "fitted" and report["reused_steps"] > 4, report
    for other in ("off", "linear"):
        assert not torch.equal(first, run_adaptive(with_options(accel_pack, model, 6, "adaptive", threshold=0.5,
                                                                forecast=other, live_blocks="first only"),
                                                   name, seed=3)), f"fitted gave forecast {other}'s output"
    assert torch.isfinite(first).all()
    run_adaptive(split_cond_uncond(fitted), name, seed=4, latent_shape=bigger(name))
    assert torch.equal(run_adaptive(fitted, name, seed=3), first), "run A changed after run B"


def test_fitted_factor_is_the_signals_progress_along_its_last_change(accel_pack):
    """The factor of forecast "fitted" (accel/deepcache/adaptive.py): the share of its last change the signal
    covered since, within 0 and the line's own factor; 0 without a change, a signal, or a matching shape."""
    progress_along = accel_pack.accel.deepcache.adaptive.progress_along
    previous = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
    reference = previous + torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(1))
    change = reference - previous
    assert progress_along(reference + 0.25 * change, reference, previous, limit=1.0) == pytest.approx(0.25)
    # what moved across the change's direction does not count
    across = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(2))
    across -= (across * change).sum() / (change * change).sum() * change
    assert progress_along(reference + 0.25 * change + across, reference, previous, limit=1.0) == pytest.approx(0.25)
    assert progress_along(reference - 0.25 * change, reference, previous, limit=1.0) == 0.0  # moved back: held
    assert progress_along(reference + 2.0 * change, reference, previous, limit=0.5) == 0.5  # never past the line
    assert progress_along(reference + change, reference, reference.clone(), limit=1.0) == 0.0  # no change
    assert progress_along(None, reference, previous, limit=1.0) == 0.0
    assert progress_along(reference[:1], reference, previous, limit=1.0) == 0.0


def test_bad_forecast_or_live_blocks_are_refused_when_the_node_runs(accel_pack, models):
    for bad in ({"forecast": "cubic"}, {"live_blocks": "last only"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            with_options(accel_pack, models["wan21"], **bad)
    # "fitted" follows the adaptive signal, which a uniform schedule does not measure: the error names the fix
    with pytest.raises(ValueError, match="set schedule to adaptive, or forecast to linear"):
        with_options(accel_pack, models["wan21"], forecast="fitted")


@pytest.mark.parametrize("schedule, forecast", [("uniform", "off"), ("adaptive", "off"), ("uniform", "linear"),
                                                ("adaptive", "fitted")])
def test_a_call_that_reuses_nothing_frees_the_old_features_before_its_blocks_run(accel_pack, models, schedule,
                                                                                  forecast):
    """At video sizes a feature is hundreds of MB on a GPU, on top of the blocks' own peak: before the blocks of a
    call that reuses nothing run, the run frees what only a reuse reads. A middle block (it runs in full calls
    and in adaptive calls where only some chunks reuse, which keep their entries) sees no entry kept by the run
    without a forecast, and no entry before the kept ones with one; in uniform mode the call is known full before
    it starts, in adaptive mode once the first block decided. And a reused call adds the residual the run keeps,
    not a copy joined from its chunks. The outputs do not depend on it: the same in a second run."""
    model = models["wan21"]
    run_key, call_key = accel_pack.accel.deepcache.runtime.RUN_KEY, accel_pack.accel.deepcache.dit_paths.CALL_KEY
    held = []  # per call in which no chunk reuses (not a mixed call): (entries kept, entries before them kept)

    def look(module, args, kwargs):
        run, call = kwargs["transformer_options"].get(run_key), kwargs["transformer_options"].get(call_key)
        if run is not None and call is not None and not (call.adaptive is not None and any(call.adaptive.reuse)):
            held.append((len(run.features), sum(e.previous is not None for e in run.features.values())))

    copied = []  # per reused call without a forecast: whether its residual is a copy of what the run keeps

    def look_reused(module, args, kwargs):
        run, call = kwargs["transformer_options"].get(run_key), kwargs["transformer_options"].get(call_key)
        if run is not None and call is not None and call.reusing and forecast == "off":
            kept = {id(entry.h[0]["img"]._base): entry.h[0]["img"]._base for entry in run.features.values()}
            if len(kept) == 1:  # every chunk's residual from one capture (not after a call where only some ran)
                copied.append(call.residuals[0]["img"] is not next(iter(kept.values())))

    cached = with_options(accel_pack, model, 3, schedule, forecast=forecast)
    sample = run_adaptive  # 20 steps: full calls that follow two full steps, whose entries a forecast keeps
    blocks = model.model.diffusion_model.blocks
    handles = [blocks[2].register_forward_pre_hook(look, with_kwargs=True),
               blocks[3].register_forward_pre_hook(look_reused, with_kwargs=True)]  # the last block runs in both
    try:
        first = sample(cached, "wan21")
    finally:
        for handle in handles:
            handle.remove()
    assert last_report(accel_pack)["reused_steps"] > 0
    assert len(held) >= 2, f"fewer than two full calls: {held}"
    if forecast == "off":
        assert all(entries == 0 for entries, _ in held), f"old features held while the blocks ran: {held}"
        assert copied and not any(copied), f"reused calls copied the kept residual: {copied}"
    else:
        assert any(entries for entries, _ in held[1:]), f"the forecast's entries were dropped: {held}"
        assert all(before == 0 for _, before in held), f"entries before the kept ones held: {held}"
    assert torch.equal(sample(cached, "wan21"), first)


# ---- signal "first block residual": First Block Cache's rule (accel/deepcache/dit_paths.py, HeadBlockPatch) ----
FIRST_BLOCK = {"live_blocks": "first only", "signal": "first block residual"}
UNCAPPED = ADAPTIVE_STEPS  # cache_interval: First Block Cache caps no run of reused steps
# On these seeded random weights the first block's residual moves far more between steps than First Block Cache's
# 0.08-0.12 on trained models: at 0.8 Flux reuses 4 of 20 steps (12 calls in part) and Wan 16 (span input: 17 both)
FBC_THRESHOLD = 0.8


@pytest.mark.parametrize("name", ("flux", "wan21"))
def test_first_block_residual_signal_decides_otherwise_and_leaks_nothing(accel_pack, models, name):
    """The signal "first block residual" (what the first block added to its input) decides other steps than the
    span's input at the same threshold; threshold 0 changes nothing; run A, then B at another size with cond and
    uncond split, then A again: bit for bit the same; split equals batched."""
    model = models[name]
    eager = run_adaptive(model, name, seed=3)
    off = with_options(accel_pack, model, UNCAPPED, "adaptive", threshold=0.0, **FIRST_BLOCK)
    assert torch.equal(run_adaptive(off, name, seed=3), eager), "threshold 0 changed the output"
    fbc = with_options(accel_pack, model, UNCAPPED, "adaptive", threshold=FBC_THRESHOLD, **FIRST_BLOCK)
    first = run_adaptive(fbc, name, seed=3)
    report = last_report(accel_pack)
    assert report["signal"] == "first block residual" and 0 < report["reused_steps"] < ADAPTIVE_STEPS - 1, report
    deep = with_options(accel_pack, model, UNCAPPED, "adaptive", threshold=FBC_THRESHOLD, live_blocks="first only")
    assert not torch.equal(run_adaptive(deep, name, seed=3), first), "the first block's residual decided nothing"
    assert last_report(accel_pack)["signal"] == "deep input"
    assert torch.isfinite(first).all()
    run_adaptive(split_cond_uncond(fbc), name, seed=4, latent_shape=bigger(name))
    assert torch.equal(run_adaptive(fbc, name, seed=3), first), "run A changed after run B"
    split = run_adaptive(split_cond_uncond(fbc), name, seed=3)
    torch.testing.assert_close(split, first, rtol=0, atol=1e-5 * first.abs().max().item(),
                               msg=lambda m: f"{name}: split cond/uncond differs from batched: {m}")


def test_first_block_residual_keeps_another_nodes_first_block_patch_and_refuses_a_later_one(accel_pack, models):
    """Another node's patch of the first block, put on before DeepCache, still runs (threshold 0: the output is
    the patched model's alone). Put on after, it replaces the patch that keeps the first block's input: every
    call runs in full, with the reason in the run's report."""
    name, model = "wan21", models["wan21"]

    patched = model.clone()
    patched.set_model_patch_replace(louder, "dit", "double_block", 0)
    alone = run_adaptive(patched, name)
    assert not torch.equal(alone, run_adaptive(model, name)), "the patch changed nothing"
    before = with_options(accel_pack, patched, UNCAPPED, "adaptive", threshold=0.0, **FIRST_BLOCK)
    assert torch.equal(run_adaptive(before, name), alone)
    after = with_options(accel_pack, model, UNCAPPED, "adaptive", threshold=FBC_THRESHOLD, **FIRST_BLOCK).clone()
    after.set_model_patch_replace(louder, "dit", "double_block", 0)
    assert torch.equal(run_adaptive(after, name), alone)
    report = last_report(accel_pack)
    assert report["reused_steps"] == 0, report
    (reason, calls), = report["ran_full"].items()
    assert "where DeepCache measures the first block's residual" in reason and "louder" in reason, report


def test_first_block_residual_is_the_adaptive_schedules_signal(accel_pack, models):
    """A fixed schedule measures no signal: the node refuses the combination with the fix, before sampling."""
    with pytest.raises(ValueError, match="set schedule to adaptive, or signal to deep input"):
        with_options(accel_pack, models["wan21"], signal="first block residual")
    with pytest.raises(ValueError, match="signal must be one of"):
        with_options(accel_pack, models["wan21"], 3, "adaptive", signal="last block")


@pytest.mark.parametrize("name, kind", [("flux", "image transformer"), ("wan21", "video transformer")])
def test_auto_takes_the_preset_of_the_models_kind(accel_pack, models, name, kind):
    """The default schedule, auto, sets interval, threshold, forecast, live blocks and signal from the kind of
    transformer (accel/deepcache/presets.py): its output is the preset's setting given by hand, bit for bit, and
    its report names the kind."""
    preset = accel_pack.accel.deepcache.presets.PRESETS[kind]
    model = models[name]
    auto = with_options(accel_pack, model, 2, "auto", threshold=0.01, forecast="off")
    out = run_adaptive(auto, name, seed=3)
    report = last_report(accel_pack)
    assert report["preset"] == kind and report["schedule"] == "adaptive", report
    assert (report["interval"], report["threshold"], report["forecast"], report["live_blocks"]) == (
        preset.interval, preset.threshold, preset.forecast, preset.live_blocks), report
    by_hand = with_options(accel_pack, model, preset.interval, "adaptive", threshold=preset.threshold,
                           forecast=preset.forecast, live_blocks=preset.live_blocks, signal=preset.signal)
    assert torch.equal(run_adaptive(by_hand, name, seed=3), out)
