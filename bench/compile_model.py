"""Compile Model against eager and ComfyUI's own TorchCompileModel node, side by side in one run.

Full-size SD1.5 UNet (accel-sd15-a), 32x32 latent, cfg (cond+uncond batched: UNet batch 2), euler. Each
variant runs in a fresh process with an empty inductor cache of its own (a true cold start) and reports:
cold first-sampling latency, steady seconds per step (median over a second run), peak RSS, and Dynamo
compiles over a 3-size sweep after the first run. When Compile Model compiles in the background (its default),
the script waits for the child process after the first sampling, then times one more sampling (the one that
loads the child's graphs) before the steady run, and reports both and the child's wall time and peak RSS.

    .venv/bin/python bench/compile_model.py [--steps 6] [--variants eager,core,accel]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(Path(__file__).resolve().parent))

from tools.harness.child import run_variants, write_report  # noqa: E402
from tools.harness.memory import peak_mib, pss_tree_mib, reset_peak, rss_mib  # noqa: E402

SWEEP_SIZES = (24, 40, 48)


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
    import comfy.sample
    import torch

    context = torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(0))

    def sample(size: int, n_steps: int) -> list[float]:
        stamps = [time.perf_counter()]
        latent_image = torch.zeros(1, 4, size, size)
        noise = comfy.sample.prepare_noise(latent_image, 0)
        comfy.sample.sample(model, noise, n_steps, 7.0, "euler", "normal", [[context, {}]],
                            [[torch.zeros_like(context), {}]], latent_image, disable_pbar=True, seed=0,
                            callback=lambda *a: stamps.append(time.perf_counter()))
        return [b - a for a, b in zip(stamps, stamps[1:])]

    return sample


def run_variant(variant: str, model_name: str, steps: int, latent: int) -> dict:
    """Inside the variant's own process."""
    from tools.comfy_env import import_comfyui

    import_comfyui(cpu=True)
    import nodes
    from torch._dynamo.utils import counters

    (model,) = nodes.UNETLoader().load_unet(model_name, "default")
    model, engine = wrap(variant, model)
    sample = sampler(model)

    loaded_rss = rss_mib()
    reset_peak()  # the load's own peak (file pages and the fp32 copy) is the same for every variant
    start = time.perf_counter()
    sample(latent, steps)
    cold = time.perf_counter() - start
    sampling_peak = peak_mib()
    pss_self, pss_children = pss_tree_mib()
    first_frames = counters["frames"]["ok"]
    background = wait_for_background(engine)
    if background is not None:  # the sampling that loads the child's graphs and makes auto mode's choices
        start = time.perf_counter()
        sample(latent, steps)
        background["loading_sampling_s"] = time.perf_counter() - start
    steady = statistics.median(sample(latent, steps)[1:])
    frames = counters["frames"]["ok"]
    for size in SWEEP_SIZES:
        sample(size, 2)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="accel-sd15-a.safetensors")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--latent", type=int, default=32)
    parser.add_argument("--variants", default="eager,core,accel,accel-compiled,accel-lowmem")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_variant(args.child, args.model, args.steps, args.latent)), flush=True)
        return

    results = run_variants(__file__, args.variants.split(","), ["--model", args.model, "--steps", str(args.steps),
                                                                "--latent", str(args.latent)])

    by = {r["variant"]: r for r in results}
    report = {"model": args.model, "latent": args.latent, "cfg_batch": 2, "steps": args.steps,
              "sweep_sizes": SWEEP_SIZES, "results": results}
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
