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

`--one-process`: steady sampling through precompiled functions against the same kinds through Dynamo, in one
process. Compile Model's defaults: its child compiles the kinds and saves them whole, this process loads them; then
an "always compiled" clone samples, alternately served by those precompiled functions and, with them set aside,
by Dynamo's own graphs of the same kinds (compiled here from torch's caches), with eager samplings in between:
interleaved rounds, so the machine's drift falls on every side. Prints the medians (ACCEL_CACHE_DIR: an empty
folder of your choice).

    .venv/bin/python bench/loaded_vs_compiled.py [--rounds 3] [--model accel-sd15-small.safetensors]
    ACCEL_CACHE_DIR=/tmp/some-empty-dir .venv/bin/python bench/loaded_vs_compiled.py --one-process [--rounds 6]
"""
from __future__ import annotations

import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools.harness import cli
from tools.harness.child import cache_env, print_result, run_result_process
from tools.harness.results import write_report
from tools.harness.sampling import conditioning, sample


def small_op_us(op, repeats: int = 300) -> float:
    """Median microseconds of `op()` in this thread."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def load(model_name: str, latent: int, steps: int):
    """The pack, the eager model, and sample(patcher) -> seconds: cfg 7, euler."""
    from tools.comfy_env import import_comfyui, load_pack

    import_comfyui(cpu=True)
    import nodes

    pack = load_pack().accel
    (model,) = nodes.UNETLoader().load_unet(model_name, "default")
    conds = conditioning()
    return pack, model, lambda patcher: sample(patcher, conds, (1, 4, latent, latent), steps, 7.0).seconds


def run_process(side: str, model_name: str, steps: int, latent: int, samplings: int) -> dict:
    import torch

    pack, model, sample_s = load(model_name, latent, steps)
    engine = pack.compile
    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    if side == "loaded":  # a restarted ComfyUI: the defaults find the kinds in the cache and load them off-path
        sample_s(engine.compile_model(model, engine.CompileOptions()))
        engine.background.BACKGROUND.wait(timeout=900)
    from torch._dynamo.utils import counters

    sample_s(always)  # compiles (compiled) or is already loaded (loaded)
    frames = counters["frames"]["ok"]
    times = [sample_s(always) for _ in range(samplings)]
    a, b = torch.randn(1, 77, 4096), torch.randn(1, 77, 4096)
    filled = torch.empty(1, 77, 4096)
    return {"side": side, "sampling_s": times, "median_sampling_s": statistics.median(times),
            "frames_while_timing": counters["frames"]["ok"] - frames,
            "cat_us": small_op_us(lambda: torch.cat([a, b])), "fill_us": small_op_us(lambda: filled.fill_(0.5)),
            "threads": importlib.import_module(pack.__name__ + ".diagnostics").thread_report(),
            "background": {k: v for k, v in engine.REGISTRY.stats()["background"].items()
                           if k in ("cpu_checks", "finished")},
            "precompiled_calls": sum(k["precompiled"]["calls"] for k in engine.REGISTRY.stats()["kinds"])}


def one_process(model_name: str, rounds: int) -> None:
    """Precompiled functions against Dynamo's graphs of the same kinds, eager between, in this process."""
    pack, model, sample_s = load(model_name, 32, 4)
    engine = pack.compile
    defaults = engine.compile_model(model, engine.CompileOptions())
    sample_s(defaults)
    engine.background.BACKGROUND.wait(timeout=900)
    sample_s(defaults)
    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    sample_s(always)
    entries = list(engine.REGISTRY._entries.values())
    saved = {id(e): e.precompiled.functions for e in entries}

    def serve_precompiled(yes: bool) -> None:
        for entry in entries:
            entry.precompiled.functions = saved[id(entry)] if yes else {}

    serve_precompiled(False)
    sample_s(always)  # Dynamo makes its graphs of the same kinds (from torch's caches)
    times = {"precompiled": [], "dynamo": [], "eager": []}
    for _ in range(rounds):
        serve_precompiled(True)
        times["precompiled"].append(sample_s(always))
        serve_precompiled(False)
        times["dynamo"].append(sample_s(always))
        times["eager"].append(sample_s(model))
    medians = {side: statistics.median(values) for side, values in times.items()}
    for side, values in times.items():
        print(f"{side}: median {medians[side]:.3f} s {[round(v, 3) for v in values]}")
    print(f"precompiled / dynamo: {medians['precompiled'] / medians['dynamo']:.3f}")
    print("kinds (label, Dynamo frames, precompiled calls):",
          [(e.kind.label, e.compiles, e.precompiled.calls) for e in entries])


def main() -> None:
    parser = cli.parser(__doc__, child=True, model="accel-sd15-small.safetensors", steps=4, latent=32, rounds=None)
    parser.add_argument("--samplings", type=int, default=5, help="timed steady samplings per process")
    parser.add_argument("--one-process", action="store_true",
                        help="precompiled functions against Dynamo's graphs in one process")
    args = parser.parse_args()
    if args.one_process:
        return one_process(args.model, args.rounds or 6)
    if args.child:
        return print_result(run_process(args.child, args.model, args.steps, args.latent, args.samplings))
    rounds = []
    for _ in range(args.rounds or 3):
        with tempfile.TemporaryDirectory(prefix="accel-bench-loaded-") as cache:
            pair = {side: run_result_process([sys.executable, __file__, "--child", side, *sys.argv[1:]],
                                             cache_env(Path(cache)), side) for side in ("compiled", "loaded")}
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
