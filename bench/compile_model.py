"""Compile Model against eager and ComfyUI's own TorchCompileModel node, side by side in one run.

Full-size SD1.5 UNet (accel-sd15-a), 32x32 latent, cfg (cond+uncond batched: UNet batch 2), euler. Each
variant runs in a fresh process with an empty inductor cache of its own (a true cold start) and reports:
cold first-sampling latency, steady seconds per step (median over a second run), peak RSS, and Dynamo
compiles over a 3-size sweep after the first run. When Compile Model compiles in the background (its default),
the script waits for the child process after the first sampling, then times one more sampling (the one that
loads the child's graphs) before the steady run, and reports both and the child's wall time and peak RSS.
`--variants eager` alone is the eager baseline the other benchmarks are measured against.

`--steady`: steady speed of each compiled variant against eager, in one process, the two interleaved. On a shared
2-core machine one process can run 20% faster or slower than the next, which swamps a comparison of steady
seconds per step made across processes: each variant's process samples its compiled MODEL and the eager one it was
made from (same weights) in alternating `--rounds`, after two warm-up runs of each, and reports the median seconds
per step of each and their ratio. The variants share one compile cache directory (this is about speed, not cold
start). Results: bench/results/compile_steady.json (compile_model.json without it).

    .venv/bin/python bench/compile_model.py [--steps 6] [--variants eager,core,accel]
    .venv/bin/python bench/compile_model.py --steady [--rounds 3] [--steps 4] [--variants core,accel,accel-compiled]
"""
from __future__ import annotations

import resource
import statistics
import time

import _path  # noqa: F401  (the project root on sys.path)
from tools.harness import cli
from tools.harness.child import print_result, run_variants
from tools.harness.memory import peak_mib, pss_tree_mib, reset_peak, rss_mib
from tools.harness.results import write_report
from tools.harness.sampling import conditioning, sample

SWEEP_SIZES = (24, 40, 48)
COLD_VARIANTS, STEADY_VARIANTS = "eager,core,accel,accel-compiled,accel-lowmem", "core,accel,accel-compiled"


def wrap(variant: str, model):
    """The variant's MODEL made from the loaded eager one (a clone sharing its weights), and the pack's engine."""
    from tools.comfy_env import load_pack

    if variant == "core":
        from comfy_extras.nodes_torch_compile import TorchCompileModel

        return TorchCompileModel.execute(model, "inductor").result[0], None
    if variant.startswith("accel"):
        engine = load_pack().accel.compile
        choose = "always compiled" if variant == "accel-compiled" else "auto"
        mode = "low-memory" if variant == "accel-lowmem" else "default"
        return engine.compile_model(model, engine.CompileOptions(mode=mode, choose=choose)), engine
    return model, None


def sampler(model):
    """sample(size, steps) -> seconds of each step: ComfyUI's sampler, euler, cfg 7 (UNet batch 2)."""
    conds = conditioning()
    return lambda size, n_steps: sample(model, conds, (1, 4, size, size), n_steps, 7.0).step_s


def load_variant(variant: str, model_name: str):
    from tools.comfy_env import import_comfyui

    import_comfyui(cpu=True)
    import nodes

    (eager,) = nodes.UNETLoader().load_unet(model_name, "default")
    return (eager, *wrap(variant, eager))


def run_variant(variant: str, model_name: str, steps: int, latent: int) -> dict:
    """Inside the variant's own process: cold first sampling, the background child, steady, the size sweep."""
    from torch._dynamo.utils import counters

    _, model, engine = load_variant(variant, model_name)
    sample_model = sampler(model)
    loaded_rss = rss_mib()
    reset_peak()  # the load's own peak (file pages and the fp32 copy) is the same for every variant
    start = time.perf_counter()
    sample_model(latent, steps)
    cold = time.perf_counter() - start
    sampling_peak = peak_mib()
    pss_self, pss_children = pss_tree_mib()
    first_frames = counters["frames"]["ok"]
    background = wait_for_background(engine)
    if background is not None:  # the sampling that loads the child's graphs and makes auto mode's choices
        start = time.perf_counter()
        sample_model(latent, steps)
        background["loading_sampling_s"] = time.perf_counter() - start
    steady = statistics.median(sample_model(latent, steps)[1:])
    frames = counters["frames"]["ok"]
    for size in SWEEP_SIZES:
        sample_model(size, 2)
    result = {
        "variant": variant, "cold_first_sample_s": cold, "steady_s_per_step": steady,
        "compiles_first_run": first_frames, "compiles_in_sweep": counters["frames"]["ok"] - frames,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # the model load's peak
        "rss_after_load_mib": loaded_rss,
        "peak_rss_first_sampling_mib": sampling_peak,  # compiling included
        # after the first sampling: this process and its compile workers, shared pages counted once
        "pss_after_first_sampling_mib": pss_self, "pss_compile_workers_mib": pss_children,
    }
    if variant.startswith("accel"):
        result.update(accel_summary(engine))
    if background is not None:
        result["background"] = background
    return result


def run_steady(variant: str, model_name: str, steps: int, latent: int, rounds: int) -> dict:
    """Inside the variant's own process: its compiled MODEL and the eager one, sampled in turn."""
    eager, compiled, engine = load_variant(variant, model_name)
    runs = {"eager": sampler(eager), variant: sampler(compiled)}
    for sample_model in runs.values():  # warm-up: loading, compiling, and auto mode's choices (about 6 UNet calls)
        sample_model(latent, steps)
        wait_for_background(engine)  # Compile Model's cold compile in a child process, if any
        sample_model(latent, steps)
    per_step: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, sample_model in runs.items():
            per_step[name] += sample_model(latent, steps)[1:]  # the first step of a run also loads the model
    medians = {name: statistics.median(times) for name, times in per_step.items()}
    result = {"variant": variant, "median_s_per_step": medians, "steps_timed": len(per_step["eager"]),
              "speed_vs_eager_same_process": medians["eager"] / medians[variant]}
    if engine is not None:
        result.update(accel_summary(engine))
    return result


def wait_for_background(engine) -> dict | None:
    """Compile Model's background compile, if one runs (choose=auto): wait for it, and say what it took.
    None when nothing compiled in the background."""
    if engine is None:
        return None
    compiler = engine.background.BACKGROUND
    start = time.perf_counter()
    compiler.wait()
    jobs = compiler.stats()["finished"]
    if not jobs:
        return None
    return {"wait_after_first_sampling_s": time.perf_counter() - start, "jobs": jobs}


def target_ratios(by: dict, peak_key: str) -> dict:
    """The compile issues' targets from the eager, core and accel results: Compile Model's added cold latency
    over core's, its steady speed against the faster of eager and core, its peak memory over eager's."""
    accel, core, eager = by["accel"], by["core"], by["eager"]
    ratios = {
        "cold_compile_vs_core": (accel["cold_first_sample_s"] - eager["cold_first_sample_s"]) /
                                max(core["cold_first_sample_s"] - eager["cold_first_sample_s"], 1e-9),
        "steady_speed_vs_faster_of_eager_and_core":
            min(eager["steady_s_per_step"], core["steady_s_per_step"]) / accel["steady_s_per_step"],
        "peak_rss_vs_eager": accel[peak_key] / eager[peak_key],
    }
    if all("paired" in r for r in (accel, core)):  # each against eager timed in turn in its own process
        ratios["steady_speed_vs_faster_of_eager_and_core_paired"] = \
            min(1.0, core["paired"]["vs_eager"]) / accel["paired"]["vs_eager"]
    return ratios


def accel_summary(engine) -> dict:
    """What Compile Model chose, from its stats: each kind's path and share, the whole-call verdicts."""
    stats = engine.REGISTRY.stats()
    return {"accel_paths": {k["kind"]: k["path"] for k in stats["kinds"]},
            "accel_compile_seconds": stats["totals"]["compile_seconds"],
            "accel_call_shares": {k["kind"]: k["call_share"] for k in stats["kinds"]},
            "accel_whole_call_checks": [{k: c[k] for k in ("verdict", "reason", "calls_timed")}
                                        for c in stats["whole_call_checks"].values()]}


def main() -> None:
    parser = cli.parser(__doc__, child=True, model="accel-sd15-a.safetensors", steps=None, latent=32, rounds=3,
                        variants=None)
    parser.add_argument("--steady", action="store_true", help="steady speed against eager, in one process each")
    args = parser.parse_args()
    args.steps = args.steps or (4 if args.steady else 6)
    args.variants = args.variants or (STEADY_VARIANTS if args.steady else COLD_VARIANTS)
    settings = {"model": args.model, "latent": args.latent, "cfg_batch": 2, "steps": args.steps}
    if args.steady:
        if args.child:
            return print_result(run_steady(args.child, args.model, args.steps, args.latent, args.rounds))
        results = run_variants(__file__, args.variants.split(","), shared_cache=True)
        ratios = {r["variant"]: r["speed_vs_eager_same_process"] for r in results}
        write_report("compile_steady", {**settings, "rounds": args.rounds, "results": results, "ratios": ratios})
        return
    if args.child:
        return print_result(run_variant(args.child, args.model, args.steps, args.latent))

    results = run_variants(__file__, args.variants.split(","))
    by = {r["variant"]: r for r in results}
    report = {**settings, "sweep_sizes": SWEEP_SIZES, "results": results}
    if {"core", "accel", "eager"} <= set(by):
        report["ratios"] = target_ratios(by, "peak_rss_mib")
        eager = by["eager"]
        for name in ("accel", "accel-compiled", "accel-lowmem", "core"):
            if name in by:
                report["ratios"][f"first_sampling_peak_rss_vs_eager[{name}]"] = (
                    by[name]["peak_rss_first_sampling_mib"] / eager["peak_rss_first_sampling_mib"])
                report["ratios"][f"pss_with_workers_vs_eager[{name}]"] = (
                    (by[name]["pss_after_first_sampling_mib"] + by[name]["pss_compile_workers_mib"]) /
                    eager["pss_after_first_sampling_mib"])
    write_report("compile_model", report)


if __name__ == "__main__":
    main()
