"""Eager baseline: full-size SD1.5 UNet through ComfyUI's UNETLoader and sampler on this machine.

Settings (the ones the issues compare at): 32x32 latent, cfg (cond+uncond batched: UNet batch 2), euler,
`--steps` steps. Reports the median seconds per step (the first step excluded) and the process's peak RSS.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from tools.comfy_env import comfyui_version, import_comfyui  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="accel-sd15-a.safetensors")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--latent", type=int, default=32, help="latent side (image side / 8)")
    args = parser.parse_args()

    comfy_dir = import_comfyui(cpu=True)
    import comfy.sample
    import nodes
    import torch

    (model,) = nodes.UNETLoader().load_unet(args.model, "default")
    context = torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(0))
    pos, neg = [[context, {}]], [[torch.zeros_like(context), {}]]
    latent = {"samples": torch.zeros(1, 4, args.latent, args.latent)}
    stamps = []
    step_callback = lambda *a: stamps.append(time.perf_counter())  # noqa: E731  (called after each step)

    start = time.perf_counter()  # comfy.sample.sample is what ComfyUI's KSampler node calls
    noise = comfy.sample.prepare_noise(latent["samples"], 0)
    comfy.sample.sample(model, noise, args.steps, 7.0, "euler", "normal", pos, neg, latent["samples"],
                        callback=step_callback, disable_pbar=True, seed=0)
    steps = [b - a for a, b in zip([start] + stamps[:-1], stamps)]
    result = {
        "benchmark": "eager_baseline",
        "model": args.model, "latent": args.latent, "cfg_batch": 2, "steps": args.steps,
        "median_s_per_step": statistics.median(steps[1:]) if len(steps) > 1 else steps[0],
        "first_step_s": steps[0],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "machine": f"{platform.machine()} {platform.processor() or ''} {__import__('os').cpu_count()} cores".strip(),
        "torch": torch.__version__, "comfyui": comfyui_version(comfy_dir), "threads": torch.get_num_threads(),
    }
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "eager_baseline.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
