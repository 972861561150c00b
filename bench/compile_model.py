"""Compile Model against eager and ComfyUI's own TorchCompileModel node, side by side in one run.

Full-size SD1.5 UNet (accel-sd15-a), 32x32 latent, cfg (cond+uncond batched: UNet batch 2), euler. Each
variant runs in a fresh process with an empty inductor cache of its own (a true cold start) and reports:
cold first-sampling latency, steady seconds per step (median over a second run), peak RSS, and Dynamo
compiles over a 3-size sweep after the first run.

    .venv/bin/python bench/compile_model.py [--steps 6] [--variants eager,core,accel]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(Path(__file__).resolve().parent))

from fresh_process import run_variants  # noqa: E402

SWEEP_SIZES = (24, 40, 48)


def run_variant(variant: str, model_name: str, steps: int, latent: int) -> dict:
    """Inside the variant's own process."""
    from tools.comfy_env import import_comfyui, load_pack

    import_comfyui(cpu=True)
    import comfy.sample
    import nodes
    import torch
    from torch._dynamo.utils import counters

    (model,) = nodes.UNETLoader().load_unet(model_name, "default")
    if variant == "core":
        from comfy_extras.nodes_torch_compile import TorchCompileModel

        model = TorchCompileModel.execute(model, "inductor").result[0]
    elif variant.startswith("accel"):
        engine = load_pack().accel.compile
        choose = "always compiled" if variant == "accel-compiled" else "auto"
        mode = "low-memory" if variant == "accel-lowmem" else "default"
        model = engine.compile_model(model, engine.CompileOptions(mode=mode, choose=choose))

    context = torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(0))

    def sample(size: int, n_steps: int) -> list[float]:
        stamps = [time.perf_counter()]
        latent_image = torch.zeros(1, 4, size, size)
        noise = comfy.sample.prepare_noise(latent_image, 0)
        comfy.sample.sample(model, noise, n_steps, 7.0, "euler", "normal", [[context, {}]],
                            [[torch.zeros_like(context), {}]], latent_image, disable_pbar=True, seed=0,
                            callback=lambda *a: stamps.append(time.perf_counter()))
        return [b - a for a, b in zip(stamps, stamps[1:])]

    start = time.perf_counter()
    sample(latent, steps)
    cold = time.perf_counter() - start
    first_frames = counters["frames"]["ok"]
    steady = statistics.median(sample(latent, steps)[1:])
    frames = counters["frames"]["ok"]
    for size in SWEEP_SIZES:
        sample(size, 2)
    result = {
        "variant": variant, "cold_first_sample_s": cold, "steady_s_per_step": steady,
        "compiles_first_run": first_frames, "compiles_in_sweep": counters["frames"]["ok"] - frames,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # compile workers (inductor's subprocess pool) are processes of their own: their peak, not their sum
        "peak_rss_largest_child_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    if variant.startswith("accel"):
        stats = engine.REGISTRY.stats()
        result["accel_paths"] = {k["kind"]: k["path"] for k in stats["kinds"]}
        result["accel_compile_seconds"] = stats["totals"]["compile_seconds"]
    return result


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

    import torch

    from tools.comfy_env import comfyui_version

    results = run_variants(__file__, args.variants.split(","), ["--model", args.model, "--steps", str(args.steps),
                                                                "--latent", str(args.latent)])

    by = {r["variant"]: r for r in results}
    report = {
        "benchmark": "compile_model", "model": args.model, "latent": args.latent, "cfg_batch": 2,
        "steps": args.steps, "sweep_sizes": SWEEP_SIZES, "results": results,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU", "torch": torch.__version__,
        "comfyui": comfyui_version(), "python": platform.python_version(),
    }
    if {"core", "accel", "eager"} <= set(by):
        accel, core, eager = by["accel"], by["core"], by["eager"]
        report["ratios"] = {
            "cold_compile_vs_core": (accel["cold_first_sample_s"] - eager["cold_first_sample_s"]) /
                                    max(core["cold_first_sample_s"] - eager["cold_first_sample_s"], 1e-9),
            "steady_speed_vs_faster_of_eager_and_core":
                min(eager["steady_s_per_step"], core["steady_s_per_step"]) / accel["steady_s_per_step"],
            "peak_rss_vs_eager": accel["peak_rss_mib"] / eager["peak_rss_mib"],
        }
        for name in ("accel-compiled", "accel-lowmem", "core"):
            if name in by:
                report["ratios"][f"peak_rss_vs_eager[{name}]"] = by[name]["peak_rss_mib"] / eager["peak_rss_mib"]
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_model.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report.get("ratios", {}), indent=2))


if __name__ == "__main__":
    main()
