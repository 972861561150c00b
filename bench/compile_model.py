"""Compile Model against eager and ComfyUI's TorchCompileModel, each variant in a fresh process with empty caches:
the full-size SD1.5 UNet; `--family flux` the benchmark Flux; `--steady` each compiled variant against the eager
model it was made from, in one process. What each measures: bench/README.md.

    .venv/bin/python bench/compile_model.py [--steps 6] [--variants eager,core,accel]
    .venv/bin/python bench/compile_model.py --family flux [--steps 4] [--latent 16] [--variants eager,core,accel]
    .venv/bin/python bench/compile_model.py --steady [--rounds 3] [--steps 4] [--variants core,accel,accel-compiled]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools.family_models import FLUX_BENCH
from tools.harness import cli
from tools.harness.child import print_result, run_variants
from tools.harness.memory import peak_mib, pss_tree_mib, reset_peak, rss_mib
from tools.harness.results import write_report
from tools.harness.sampling import conditioning, sample, synced_clock
from tools.harness.variants import frames, load_unet, rel_error, variant_model, wait_for_background

SWEEP_SIZES = (24, 40, 48)
FLUX_TOKENS, FLUX_SIZES = (77, 154, 231), (24, 32)  # the Flux sweeps: prompt lengths, then latent sizes after 16
# Per family and measurement, the defaults of: model file, steps, latent, variants
DEFAULTS = {("sd15", False): ("accel-sd15-a.safetensors", 6, 32, "eager,core,accel,accel-compiled,accel-lowmem"),
            ("sd15", True): ("accel-sd15-a.safetensors", 4, 32, "core,accel,accel-compiled"),
            ("flux", False): (FLUX_BENCH.file_name, 4, 16, "eager,core,accel")}


def sampler(model, flux: bool = False):
    """sample(size, steps, tokens) -> Sampled: ComfyUI's sampler, euler; the SD1.5 UNet's inputs at cfg 7 (UNet
    batch 2), or Flux's at cfg 1 with `tokens` prompt states."""
    def sample_model(size: int, n_steps: int, tokens: int = 77):
        if flux:
            return sample(model, conditioning(4096, tokens, pooled=True), (1, 16, size, size), n_steps, 1.0)
        return sample(model, conditioning(), (1, 4, size, size), n_steps, 7.0)

    return sample_model


def load_variant(variant: str, model_name: str, cpu: bool = True):
    """(the eager MODEL, the variant's MODEL, the pack's engine or None), ComfyUI imported."""
    eager = load_unet(model_name, cpu)
    return (eager, *variant_model(variant, eager))


def run_variant(variant: str, model_name: str, steps: int, latent: int) -> dict:
    """Inside the variant's own process: cold first sampling, the background child, steady, the size sweep."""
    _, model, engine = load_variant(variant, model_name)
    sample_model = sampler(model)
    loaded_rss = rss_mib()
    reset_peak()  # the load's own peak (file pages and the fp32 copy) is the same for every variant
    start = time.perf_counter()
    sample_model(latent, steps)
    cold = time.perf_counter() - start
    sampling_peak = peak_mib()
    pss_self, pss_children = pss_tree_mib()
    first_frames = frames()
    background = background_and_loading(engine, lambda: sample_model(latent, steps))
    steady = statistics.median(sample_model(latent, steps).step_s[1:])
    before = frames()
    for size in SWEEP_SIZES:
        sample_model(size, 2)
    result = {
        "variant": variant, "cold_first_sample_s": cold, "steady_s_per_step": steady,
        "compiles_first_run": first_frames, "compiles_in_sweep": frames() - before,
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
            per_step[name] += sample_model(latent, steps).step_s[1:]  # the first step of a run also loads the model
    medians = {name: statistics.median(times) for name, times in per_step.items()}
    result = {"variant": variant, "median_s_per_step": medians, "steps_timed": len(per_step["eager"]),
              "speed_vs_eager_same_process": medians["eager"] / medians[variant]}
    if engine is not None:
        result.update(accel_summary(engine))
    return result


def paired_steady(sample_variant, sample_eager, latent: int, steps: int, rounds: int = 4) -> dict:
    """The variant's and plain eager's seconds per step in this process, sampling by sampling in turn (first
    steps left out). This machine's speed drifts within a process (eager alone went from 1.27 to 1.46 s per
    step over four samplings of the benchmark Flux, 2026-11-22), so a variant is compared with eager timed in
    the same minutes. The order alternates (variant first, then eager first): with the variant always first, the
    eager variant's pair with itself came out 0.96 in two runs, the second sampling of a pair being slower. The
    eager variant's own pair says how far apart two identical runs come."""
    variant, eager = [], []
    for round_ in range(rounds):
        pair = (sample_variant, sample_eager) if round_ % 2 == 0 else (sample_eager, sample_variant)
        times = [sample_model(latent, steps).step_s[1:] for sample_model in pair]
        variant += times[0] if round_ % 2 == 0 else times[1]
        eager += times[1] if round_ % 2 == 0 else times[0]
    return {"s_per_step": statistics.median(variant), "eager_s_per_step": statistics.median(eager),
            "vs_eager": statistics.median(variant) / statistics.median(eager)}


def run_flux_variant(variant: str, model_name: str, steps: int, latent: int, outputs: Path) -> dict:
    """Inside the variant's own process (--family flux): cold, background, steady alone and paired, the sweeps;
    the first and a steady output saved to `outputs` for the parent to compare with eager's."""
    import torch

    gpu = torch.cuda.is_available()
    base, model, engine = load_variant(variant, model_name, cpu=not gpu)
    sample_model = sampler(model, flux=True)
    loaded_rss = rss_mib()
    reset_peak()  # the load's own peak is the same for every variant
    start = time.perf_counter()
    first = sample_model(latent, steps).out
    cold = synced_clock() - start
    result = {"variant": variant, "cold_first_sample_s": cold, "compiles_first_run": frames(),
              "rss_after_load_mib": loaded_rss}
    background = background_and_loading(engine, lambda: sample_model(latent, steps))
    if background is not None:
        result["background"] = background
    steady, steady_again = sample_model(latent, steps), sample_model(latent, steps)
    result["steady_s_per_step"] = statistics.median(steady.step_s[1:] + steady_again.step_s[1:])
    result["paired"] = paired_steady(sample_model, sampler(base, flux=True), latent, steps)
    if gpu:  # what the GPU itself spends a step on, against the wall time: the launch-bound share
        result["kernel_ms_per_step"] = kernel_ms_per_step(lambda: sample_model(latent, steps), steps)
    for name, values, kwargs in (("prompt_length", FLUX_TOKENS, lambda v: {"tokens": v}),
                                 ("size", FLUX_SIZES, lambda v: {"size": v})):
        for key in (f"compiles_in_{name}_sweep", f"compiles_in_repeated_{name}_sweep"):
            before = frames()
            for value in values:
                sample_model(**{"size": latent, "n_steps": 1, **kwargs(value)})
            result[key] = frames() - before
    result["peak_rss_sampling_mib"] = peak_mib()  # compiling and all samplings included
    if gpu:
        result["peak_gpu_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    torch.save({"first": first, "steady": steady_again.out}, outputs / f"{variant}.pt")
    if engine is not None:
        result.update(accel_summary(engine))
    return result


def kernel_ms_per_step(run, steps: int) -> float:
    """The GPU's busy time per step in one sampling (`run`), from torch.profiler: every kernel, copy and fill on
    the device, each counted once (its self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    return sum(event.self_device_time_total for event in prof.key_averages()) / 1e3 / steps


def background_and_loading(engine, resample) -> dict | None:
    """wait_for_background, then the sampling that loads the child's graphs and makes auto mode's choices
    (`resample`), timed; None when nothing compiled in the background."""
    background = wait_for_background(engine)
    if background is not None:
        start = time.perf_counter()
        resample()
        background["loading_sampling_s"] = time.perf_counter() - start
    return background


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
            "accel_graphs": {k["kind"]: k["cuda_graphs"] for k in stats["kinds"] if k.get("cuda_graphs")},
            "accel_whole_call_checks": [{k: c[k] for k in ("verdict", "reason", "calls_timed")}
                                        for c in stats["whole_call_checks"].values()]}


def flux_errors(results: list[dict], outputs: Path) -> None:
    """Each output's largest error against eager's, relative to eager's largest value, into its result."""
    import torch

    saved = {r["variant"]: torch.load(outputs / f"{r['variant']}.pt") for r in results}
    if "eager" in saved:
        for result in results:
            for which in ("first", "steady"):
                result[f"max_rel_error_vs_eager_{which}"] = rel_error(saved[result["variant"]][which],
                                                                      saved["eager"][which])


def main() -> None:
    parser = cli.parser(__doc__, child=True, model=None, steps=None, latent=None, rounds=3, variants=None)
    parser.add_argument("--family", choices=("sd15", "flux"), default="sd15", help="the SD1.5 UNet or Flux")
    parser.add_argument("--steady", action="store_true", help="steady speed against eager, in one process each")
    parser.add_argument("--outputs", help=argparse.SUPPRESS)  # --family flux: where a child saves its outputs
    args = parser.parse_args()
    if (args.family, args.steady) not in DEFAULTS:
        parser.error("--steady measures the SD1.5 UNet")
    for name, default in zip(("model", "steps", "latent", "variants"), DEFAULTS[args.family, args.steady]):
        setattr(args, name, getattr(args, name) or default)
    if args.steps < 2:  # each steady time leaves out its sampling's first step (it also loads the model)
        parser.error(f"--steps {args.steps}: use 2 or more (steady seconds per step leave out each sampling's "
                     "first step)")
    variants = args.variants.split(",")
    if args.family == "flux":
        if args.child:
            return print_result(run_flux_variant(args.child, args.model, args.steps, args.latent,
                                                 Path(args.outputs)))
        with tempfile.TemporaryDirectory(prefix="accel-bench-flux-") as outputs:
            results = run_variants(__file__, variants, [*sys.argv[1:], "--outputs", outputs])
            flux_errors(results, Path(outputs))
        report = {"model": args.model, "architecture": "Flux, hidden 3072, 24 heads, 2 double + 4 single blocks",
                  "latent": args.latent, "steps": args.steps, "cfg": 1.0, "tokens": FLUX_TOKENS,
                  "sweep_sizes": FLUX_SIZES, "results": results}
        if {"core", "accel", "eager"} <= {r["variant"] for r in results}:
            report["ratios"] = target_ratios({r["variant"]: r for r in results}, "peak_rss_sampling_mib")
        write_report("compile_flux", report)
        return
    settings = {"model": args.model, "latent": args.latent, "cfg_batch": 2, "steps": args.steps}
    if args.steady:
        if args.child:
            return print_result(run_steady(args.child, args.model, args.steps, args.latent, args.rounds))
        results = run_variants(__file__, variants, shared_cache=True)
        ratios = {r["variant"]: r["speed_vs_eager_same_process"] for r in results}
        write_report("compile_steady", {**settings, "rounds": args.rounds, "results": results, "ratios": ratios})
        return
    if args.child:
        return print_result(run_variant(args.child, args.model, args.steps, args.latent))

    results = run_variants(__file__, variants)
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
