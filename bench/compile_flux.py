"""Compile Model on a Flux-architecture model at full width, against eager and ComfyUI's TorchCompileModel.

The benchmark Flux (tools/family_models.FLUX_BENCH: hidden 3072, 24 heads, 2 double + 4 single blocks, 1.3 B
parameters), sampled by ComfyUI's sampler at cfg 1 (guidance distilled: one model call per step), euler, with
T5-width (4096) prompt states of 77 tokens and a pooled CLIP vector fed directly. Each variant runs in a fresh
process with empty caches (bench/fresh_process.py) and reports: the cold first sampling, the sampling after
Compile Model's background child (if one ran), steady seconds per step (alone, and in turn with plain eager
in the same process: the paired ratio the steady target is read from), peak RSS, compiles over a prompt-length
sweep (77, 154, 231 tokens) and a size sweep (latents 24 and 32 after 16), and each output's largest error
against eager's.

    .venv/bin/python bench/compile_flux.py [--steps 4] [--latent 16] [--variants eager,core,accel]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from compile_model import accel_summary, target_ratios, wait_for_background, wrap
from tools.family_models import FLUX_BENCH
from tools.harness import cli
from tools.harness.child import print_result, run_variants
from tools.harness.memory import peak_mib, reset_peak, rss_mib
from tools.harness.results import write_report
from tools.harness.sampling import conditioning, sample, synced_clock

MODEL = FLUX_BENCH.file_name
TOKENS = (77, 154, 231)
SIZES = (24, 32)


def sampler(model):
    """sample(latent, steps, tokens) -> (output, seconds of each step): ComfyUI's sampler, Flux's inputs."""
    def sample_model(latent: int, steps: int, tokens: int = TOKENS[0]):
        run = sample(model, conditioning(4096, tokens, pooled=True), (1, 16, latent, latent), steps, 1.0)
        return run.out, run.step_s

    return sample_model


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
        times = [sample(latent, steps)[1][1:] for sample in pair]
        variant += times[0] if round_ % 2 == 0 else times[1]
        eager += times[1] if round_ % 2 == 0 else times[0]
    return {"s_per_step": statistics.median(variant), "eager_s_per_step": statistics.median(eager),
            "vs_eager": statistics.median(variant) / statistics.median(eager)}


def run_variant(variant: str, steps: int, latent: int, outputs: Path) -> dict:
    """Inside the variant's own process."""
    import torch

    from tools.comfy_env import import_comfyui

    gpu = torch.cuda.is_available()
    import_comfyui(cpu=not gpu)
    import nodes
    from torch._dynamo.utils import counters

    (base,) = nodes.UNETLoader().load_unet(MODEL, "default")
    model, engine = wrap(variant, base)
    sample = sampler(model)
    loaded_rss = rss_mib()
    reset_peak()  # the load's own peak is the same for every variant
    start = time.perf_counter()
    first, _ = sample(latent, steps)
    cold = synced_clock() - start
    result = {"variant": variant, "cold_first_sample_s": cold, "compiles_first_run": counters["frames"]["ok"],
              "rss_after_load_mib": loaded_rss}
    background = wait_for_background(engine)
    if background is not None:  # the sampling that loads the child's graphs and makes auto mode's choices
        start = time.perf_counter()
        sample(latent, steps)
        background["loading_sampling_s"] = time.perf_counter() - start
        result["background"] = background
    steady, times = sample(latent, steps)
    steady_again, times_again = sample(latent, steps)
    result["steady_s_per_step"] = statistics.median(times[1:] + times_again[1:])
    result["paired"] = paired_steady(sample, sampler(base), latent, steps)
    for name, values, kwargs in (("prompt_length", TOKENS, lambda v: {"tokens": v}),
                                 ("size", SIZES, lambda v: {"latent": v})):
        frames = counters["frames"]["ok"]
        for value in values:
            sample(**{"latent": latent, "steps": 1, **kwargs(value)})
        result[f"compiles_in_{name}_sweep"] = counters["frames"]["ok"] - frames
        frames = counters["frames"]["ok"]
        for value in values:
            sample(**{"latent": latent, "steps": 1, **kwargs(value)})
        result[f"compiles_in_repeated_{name}_sweep"] = counters["frames"]["ok"] - frames
    result["peak_rss_sampling_mib"] = peak_mib()  # compiling and all samplings included
    if gpu:
        result["peak_gpu_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    torch.save({"first": first, "steady": steady_again}, outputs / f"{variant}.pt")
    if engine is not None:
        result.update(accel_summary(engine))
    return result


def main() -> None:
    parser = cli.parser(__doc__, child=True, steps=4, latent=16, variants="eager,core,accel")
    parser.add_argument("--outputs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return print_result(run_variant(args.child, args.steps, args.latent, Path(args.outputs)))

    import torch

    with tempfile.TemporaryDirectory(prefix="accel-bench-flux-") as outputs:
        results = run_variants(__file__, args.variants.split(","), ["--steps", str(args.steps), "--latent",
                                                                    str(args.latent), "--outputs", outputs])
        saved = {r["variant"]: torch.load(Path(outputs) / f"{r['variant']}.pt") for r in results}
    by = {r["variant"]: r for r in results}
    if "eager" in saved:  # each output's largest error, relative to eager's largest value
        for variant, out in saved.items():
            for which in ("first", "steady"):
                reference = saved["eager"][which]
                error = (out[which] - reference).abs().max().item() / reference.abs().max().item()
                by[variant][f"max_rel_error_vs_eager_{which}"] = error
    report = {"model": MODEL, "architecture": "Flux, hidden 3072, 24 heads, 2 double + 4 single blocks",
              "latent": args.latent, "steps": args.steps, "cfg": 1.0, "tokens": TOKENS, "sweep_sizes": SIZES,
              "results": results}
    if {"core", "accel", "eager"} <= set(by):
        report["ratios"] = target_ratios(by, "peak_rss_sampling_mib")
    write_report("compile_flux", report)


if __name__ == "__main__":
    main()
