"""Steady speed of a compiled UNet against eager, in one process, with the two interleaved.

On a shared 2-core machine, one process can run 20% faster or slower than the next, which swamps a comparison of
steady seconds per step made across processes. Here each variant's process samples its compiled MODEL and the
eager one it was made from (same weights) in alternating rounds, after two warm-up runs of each, and reports the
median seconds per step of each and their ratio. Full-size SD1.5 UNet, 32x32 latent, cfg 7 (UNet batch 2), euler.
The variants share one compile cache directory (this is about speed, not cold start).

    .venv/bin/python bench/compile_steady.py [--rounds 3] [--steps 4] [--variants core,accel,accel-compiled]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(Path(__file__).resolve().parent))

from compile_model import accel_summary, sampler, wait_for_background, wrap  # noqa: E402
from tools.harness.child import run_variants, write_report  # noqa: E402


def run_variant(variant: str, model_name: str, steps: int, latent: int, rounds: int) -> dict:
    from tools.comfy_env import import_comfyui

    import_comfyui(cpu=True)
    import nodes

    (eager,) = nodes.UNETLoader().load_unet(model_name, "default")
    compiled, engine = wrap(variant, eager)
    runs = {"eager": sampler(eager), variant: sampler(compiled)}
    for sample in runs.values():  # warm-up: loading, compiling, and auto mode's choices (about 6 UNet calls)
        sample(latent, steps)
        wait_for_background(engine)  # Compile Model's cold compile in a child process, if any
        sample(latent, steps)
    per_step: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, sample in runs.items():
            per_step[name] += sample(latent, steps)[1:]  # the first step of a run also loads the model
    medians = {name: statistics.median(times) for name, times in per_step.items()}
    result = {"variant": variant, "median_s_per_step": medians, "steps_timed": len(per_step["eager"]),
              "speed_vs_eager_same_process": medians["eager"] / medians[variant]}
    if engine is not None:
        result.update(accel_summary(engine))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="accel-sd15-a.safetensors")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--latent", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="core,accel,accel-compiled")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_variant(args.child, args.model, args.steps, args.latent, args.rounds)),
              flush=True)
        return
    child_args = ["--model", args.model, "--steps", str(args.steps), "--latent", str(args.latent),
                  "--rounds", str(args.rounds)]
    results = run_variants(__file__, args.variants.split(","), child_args, shared_cache=True)
    ratios = {r["variant"]: r["speed_vs_eager_same_process"] for r in results}
    write_report("compile_steady", {"model": args.model, "latent": args.latent, "cfg_batch": 2,
                                    "steps": args.steps, "rounds": args.rounds, "results": results,
                                    "ratios": ratios})


if __name__ == "__main__":
    main()
