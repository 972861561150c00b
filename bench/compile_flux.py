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
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(Path(__file__).resolve().parent))

from compile_model import accel_summary, target_ratios, wait_for_background, wrap  # noqa: E402
from tools.harness.child import run_variants, write_report  # noqa: E402
from tools.harness.memory import peak_mib, reset_peak, rss_mib  # noqa: E402
from tools.harness.sampling import synced_clock  # noqa: E402
from tools.family_models import FLUX_BENCH  # noqa: E402

MODEL = FLUX_BENCH.file_name
TOKENS = (77, 154, 231)
SIZES = (24, 32)


def sampler(model):
    """sample(latent, steps, tokens) -> (output, seconds of each step): ComfyUI's sampler, Flux's inputs."""
    import comfy.sample
    import torch

    def sample(latent: int, steps: int, tokens: int = TOKENS[0]):
        generator = torch.Generator().manual_seed(0)
        context = torch.randn(1, tokens, 4096, generator=generator)
        extras = {"pooled_output": torch.randn(1, 768, generator=generator), "guidance": 3.5}
        negative = {"pooled_output": torch.zeros(1, 768), "guidance": 3.5}
        image = torch.zeros(1, 16, latent, latent)
        noise = comfy.sample.prepare_noise(image, 0)
        stamps = [time.perf_counter()]
        out = comfy.sample.sample(model, noise, steps, 1.0, "euler", "normal", [[context, extras]],
                                  [[torch.zeros_like(context), negative]], image, disable_pbar=True, seed=0,
                                  callback=lambda *a: stamps.append(synced_clock()))
        return out, [b - a for a, b in zip(stamps, stamps[1:])]

    return sample


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--latent", type=int, default=16)
    parser.add_argument("--variants", default="eager,core,accel")
    parser.add_argument("--outputs", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_variant(args.child, args.steps, args.latent, Path(args.outputs))
        print("RESULT " + json.dumps(result), flush=True)
        return

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
