"""Thread hygiene (#32, item 3): does a process that loaded its compiled graphs from the cache step as fast as one
that compiled them itself?

Each round runs two fresh processes on one empty cache: "compiled" compiles every kind in its prompt thread
(choose=always compiled, so both processes run the very same graphs); "loaded" starts on that cache with the
defaults, so everything the pack does in a restarted ComfyUI runs (inductor's CPU checks in their thread, a child
saving each kind whole from torch's caches, its precompiled functions loaded: compile/precompiled.py), then
samples through an "always compiled" clone (same kinds, the precompiled graphs, no Dynamo). Both then time
steady samplings and, in the prompt thread, a sampler-sized `torch.cat` and `fill_` (1x77x4096 floats: the CPU-side ops that took 4-6 ms in the slow loaded
processes of the one GPU run, docs/benchmarks/gpu_h100.md), and report the thread diagnostic
(`python -m accel doctor`'s). Rounds interleave the two, so the machine's drift falls on both; medians per side.

    .venv/bin/python bench/loaded_vs_compiled.py [--rounds 3] [--model accel-sd15-small.safetensors]
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(Path(__file__).resolve().parent))

from tools.harness.child import run_result_process, write_report  # noqa: E402


def small_op_us(op, repeats: int = 300) -> float:
    """Median microseconds of `op()` in this thread."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run_process(side: str, model_name: str, steps: int, latent: int, samplings: int) -> dict:
    from tools.comfy_env import import_comfyui, load_pack

    import_comfyui(cpu=True)
    import comfy.sample
    import nodes
    import torch

    pack = load_pack().accel
    engine = pack.compile
    (model,) = nodes.UNETLoader().load_unet(model_name, "default")
    context = torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(0))
    latent_image = torch.zeros(1, 4, latent, latent)

    def sample(patcher) -> float:
        start = time.perf_counter()
        comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent_image, 0), steps, 7.0, "euler", "normal",
                            [[context, {}]], [[torch.zeros_like(context), {}]], latent_image, disable_pbar=True,
                            seed=0)
        return time.perf_counter() - start

    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    if side == "loaded":  # a restarted ComfyUI: the defaults find the kinds in the cache and load them off-path
        sample(engine.compile_model(model, engine.CompileOptions()))
        engine.background.BACKGROUND.wait(timeout=900)
    from torch._dynamo.utils import counters

    sample(always)  # compiles (compiled) or is already loaded (loaded)
    frames = counters["frames"]["ok"]
    times = [sample(always) for _ in range(samplings)]
    a, b = torch.randn(1, 77, 4096), torch.randn(1, 77, 4096)
    filled = torch.empty(1, 77, 4096)
    return {"side": side, "sampling_s": times, "median_sampling_s": statistics.median(times),
            "frames_while_timing": counters["frames"]["ok"] - frames,
            "cat_us": small_op_us(lambda: torch.cat([a, b])), "fill_us": small_op_us(lambda: filled.fill_(0.5)),
            "threads": importlib.import_module(pack.__name__ + ".diagnostics").thread_report(),
            "background": {k: v for k, v in engine.REGISTRY.stats()["background"].items()
                           if k in ("cpu_checks", "finished")},
            "precompiled_calls": sum(k["precompiled"]["calls"] for k in engine.REGISTRY.stats()["kinds"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="accel-sd15-small.safetensors")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--latent", type=int, default=32)
    parser.add_argument("--samplings", type=int, default=5, help="timed steady samplings per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    child_args = ["--model", args.model, "--steps", str(args.steps), "--latent", str(args.latent),
                  "--samplings", str(args.samplings)]
    if args.child:
        print("RESULT " + json.dumps(run_process(args.child, args.model, args.steps, args.latent, args.samplings)),
              flush=True)
        return
    rounds = []
    for number in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="accel-bench-loaded-") as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(cache) / "torch"),
                   "ACCEL_CACHE_DIR": str(Path(cache) / "accel")}
            pair = {side: run_result_process([sys.executable, __file__, "--child", side, *child_args], env, side)
                    for side in ("compiled", "loaded")}
        rounds.append(pair)
        print(json.dumps({side: {k: pair[side][k] for k in ("median_sampling_s", "cat_us", "fill_us",
                                                              "frames_while_timing")} for side in pair}), flush=True)

    def median(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    ratios = {key: median("loaded", key) / median("compiled", key)
              for key in ("median_sampling_s", "cat_us", "fill_us")}
    write_report("loaded_vs_compiled", {"model": args.model, "latent": args.latent, "steps": args.steps,
                                        "rounds": rounds, "ratios": ratios})


if __name__ == "__main__":
    main()
