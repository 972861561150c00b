"""Cold start with Compile Model in fresh processes on shared caches (bench/README.md): rounds of three (a first
process, a restart and a new fleet worker on a Redis store, #33), or with --loaded-vs-compiled of two (one that
compiles every kind, one that loads them from the cache, #32), or --one-process (precompiled functions against
Dynamo's graphs of the same kinds, ACCEL_CACHE_DIR an empty folder of your choice).

    .venv/bin/python bench/cold_start.py [--rounds 2] [--model accel-sd15-small.safetensors] [--steps 4]
    .venv/bin/python bench/cold_start.py --loaded-vs-compiled [--rounds 3] [--samplings 5]
    ACCEL_CACHE_DIR=/tmp/some-empty-dir .venv/bin/python bench/cold_start.py --one-process [--rounds 6]
"""
from __future__ import annotations

import hashlib
import importlib
import json
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools.harness import cli
from tools.harness.child import cache_env, print_result, run_result_process
from tools.harness.results import write_report
from tools.harness.sampling import conditioning, sample
from tools.harness.variants import frames, load_unet

SECRET = "bench-fleet-secret-0123456789"
FLEET = {"first": "a", "restart": "a", "worker": "b"}  # each process's local cache: a restart has the first's
PAIR = {"compiled": "a", "loaded": "a"}  # the loaded process starts on the compiled one's cache


def load(args):
    """The pack's engine, the pack, the eager model, and prompt(patcher) -> Sampled: cfg 7, euler."""
    from tools.comfy_env import load_pack

    pack = load_pack().accel
    model = load_unet(args.model)
    conds = conditioning()
    return pack.compile, pack, model, lambda patcher: sample(patcher, conds, (1, 4, args.latent, args.latent),
                                                               args.steps, 7.0)


def fleet_process(side: str, args) -> dict:
    """One process of a fleet round: an eager prompt, prompt 1 with the defaults (eagerly, while the child
    compiles or the CPU checks run), the background work waited for, the first compiled prompt (it loads the
    precompiled functions: the hand-over), then eager and compiled prompts interleaved."""
    engine, _, model, prompt = load(args)
    compiled = engine.compile_model(model, engine.CompileOptions())
    eager_first = prompt(model).seconds
    first_s = prompt(compiled).seconds
    wait_start = time.perf_counter()
    engine.background.BACKGROUND.wait(timeout=1800)
    waited = time.perf_counter() - wait_start
    before = frames()
    handover_s = prompt(compiled).seconds
    eager_s, compiled_s = [], []
    for _ in range(3):  # interleaved: the machine's drift falls on both
        eager_s.append(prompt(model).seconds)
        compiled_s.append(prompt(compiled).seconds)
    stats = engine.REGISTRY.stats()
    frames_at_end = frames()
    # The outputs compared across processes: auto mode times some calls eagerly, and which ones depends on the
    # machine's noise, so the comparison goes through an always-compiled clone (the same kinds and graphs).
    out = prompt(engine.compile_model(model, engine.CompileOptions(choose="always compiled"))).out
    kinds = [k for k in stats["kinds"] if k["precompiled"]["functions"]]
    env = stats["compile_cache"]["environments"][0]
    return {"side": side, "eager_first_prompt_s": eager_first, "first_prompt_s": first_s, "waited_s": waited,
            "first_compiled_prompt_s": handover_s, "eager_s": eager_s, "compiled_s": compiled_s,
            "dynamo_frames": frames_at_end, "frames_from_first_compiled_prompt": frames_at_end - before,
            "compile_seconds_in_process": stats["totals"]["compile_seconds"],
            "child_jobs": [{"wall_s": j["wall_seconds"], "cold_graphs": j["cold_graphs"]}
                           for j in stats["background"]["finished"]],
            "cpu_checks_s": stats["background"]["cpu_checks"]["seconds"],
            "kinds_precompiled": len(kinds), "precompiled_functions": sum(k["precompiled"]["functions"] for k in kinds),
            "precompiled_load_s": sum(k["precompiled"]["load_seconds"] for k in kinds),
            "precompiled_from_remote": env.get("precompiled_from_remote", 0),
            "output_sha256": hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]}


def small_op_us(op, repeats: int = 300) -> float:
    """Median microseconds of `op()` in this thread."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def pair_process(side: str, args) -> dict:
    """--loaded-vs-compiled: "compiled" compiles every kind in its prompt thread (choose=always compiled, so both
    processes run the very same graphs); "loaded" starts with the defaults on that cache, as a restarted ComfyUI
    (CPU checks, a child saving each kind whole, its precompiled functions loaded), then samples through an always
    compiled clone. Both: steady samplings, and a sampler-sized cat and fill_ in the prompt thread (the CPU-side ops
    that took 4-6 ms in the slow loaded processes of docs/benchmarks/gpu_h100.md), and the thread report."""
    import torch

    engine, pack, model, prompt = load(args)
    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    if side == "loaded":  # a restarted ComfyUI: the defaults find the kinds in the cache and load them off-path
        prompt(engine.compile_model(model, engine.CompileOptions()))
        engine.background.BACKGROUND.wait(timeout=900)
    prompt(always)  # compiles (compiled) or is already loaded (loaded)
    before = frames()
    times = [prompt(always).seconds for _ in range(args.samplings)]
    a, b = torch.randn(1, 77, 4096), torch.randn(1, 77, 4096)
    filled = torch.empty(1, 77, 4096)
    return {"side": side, "sampling_s": times, "median_sampling_s": statistics.median(times),
            "frames_while_timing": frames() - before,
            "cat_us": small_op_us(lambda: torch.cat([a, b])), "fill_us": small_op_us(lambda: filled.fill_(0.5)),
            "threads": importlib.import_module(pack.__name__ + ".diagnostics").thread_report(),
            "background": {k: v for k, v in engine.REGISTRY.stats()["background"].items()
                           if k in ("cpu_checks", "finished")},
            "precompiled_calls": sum(k["precompiled"]["calls"] for k in engine.REGISTRY.stats()["kinds"])}


def one_process(args) -> None:
    """--one-process: the defaults' child compiles the kinds and saves them whole, this process loads them; then an
    always compiled clone samples, alternately served by those precompiled functions and, with them set aside, by
    Dynamo's own graphs of the same kinds (from torch's caches), with eager samplings between, in rounds."""
    engine, _, model, prompt = load(args)
    defaults = engine.compile_model(model, engine.CompileOptions())
    prompt(defaults)
    engine.background.BACKGROUND.wait(timeout=900)
    prompt(defaults)
    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    prompt(always)
    entries = list(engine.REGISTRY._entries.values())
    saved = {id(e): e.precompiled.functions for e in entries}

    def serve_precompiled(yes: bool) -> None:
        for entry in entries:
            entry.precompiled.functions = saved[id(entry)] if yes else {}

    serve_precompiled(False)
    prompt(always)  # Dynamo makes its graphs of the same kinds (from torch's caches)
    times = {"precompiled": [], "dynamo": [], "eager": []}
    for _ in range(args.rounds or 6):
        serve_precompiled(True)
        times["precompiled"].append(prompt(always).seconds)
        serve_precompiled(False)
        times["dynamo"].append(prompt(always).seconds)
        times["eager"].append(prompt(model).seconds)
    medians = {side: statistics.median(values) for side, values in times.items()}
    for side, values in times.items():
        print(f"{side}: median {medians[side]:.3f} s {[round(v, 3) for v in values]}")
    print(f"precompiled / dynamo: {medians['precompiled'] / medians['dynamo']:.3f}")
    print("kinds (label, Dynamo frames, precompiled calls):",
          [(e.kind.label, e.compiles, e.precompiled.calls) for e in entries])


def one_round(sides: dict) -> dict:
    """Each side in a fresh process of its own, in turn, on its local cache; a fleet's on one Redis store too."""
    from tools.redis_server import RedisServer

    with tempfile.TemporaryDirectory(prefix="accel-bench-cold-") as tmp, \
            RedisServer(Path(tmp) / "redis") if sides is FLEET else nullcontext() as redis:
        store = {"ACCEL_REMOTE_CACHE": redis.url, "ACCEL_REMOTE_CACHE_KEY": SECRET} if redis else {}
        found = {}
        for side, cache in sides.items():
            found[side] = run_result_process([sys.executable, __file__, "--child", side, *sys.argv[1:]],
                                             {**cache_env(Path(tmp) / cache), **store}, side)
            print(json.dumps({k: v for k, v in found[side].items() if k != "threads"}), flush=True)
    return found


def fleet_summary(rounds: list[dict]) -> dict:
    def med(values):
        return round(statistics.median(values), 3)

    out = {}
    for side in FLEET:
        runs = [r[side] for r in rounds]
        out[side] = {
            "first_compiled_prompt_vs_eager": med([r["first_compiled_prompt_s"] / statistics.median(r["eager_s"])
                                                   for r in runs]),
            "steady_compiled_vs_eager": med([statistics.median(r["compiled_s"]) / statistics.median(r["eager_s"])
                                             for r in runs]),
            "load_s_per_kind": med([r["precompiled_load_s"] / max(1, r["kinds_precompiled"]) for r in runs]),
            "dynamo_frames": max(r["dynamo_frames"] for r in runs),
            "child_wall_s": med([sum(j["wall_s"] for j in r["child_jobs"]) for r in runs]),
        }
    first_compile = [sum(j["wall_s"] for j in r["first"]["child_jobs"]) for r in rounds]
    # what a new worker spends making its graphs usable before its first compiled prompt: compiling (Dynamo or a
    # child) and loading the precompiled functions
    worker_spent = [r["worker"]["compile_seconds_in_process"] + sum(j["wall_s"] for j in r["worker"]["child_jobs"])
                    + r["worker"]["precompiled_load_s"] for r in rounds]
    out["worker_compile_vs_first"] = med([w / f for w, f in zip(worker_spent, first_compile)])
    out["worker_output_equals_first"] = all(r["worker"]["output_sha256"] == r["first"]["output_sha256"]
                                            for r in rounds)
    return out


def main() -> None:
    parser = cli.parser(__doc__, child=True, model="accel-sd15-small.safetensors", steps=4, latent=32, rounds=None)
    parser.add_argument("--loaded-vs-compiled", action="store_true",
                        help="a process that compiles every kind against one that loads them")
    parser.add_argument("--samplings", type=int, default=5, help="--loaded-vs-compiled: timed steady samplings")
    parser.add_argument("--one-process", action="store_true",
                        help="precompiled functions against Dynamo's graphs in one process")
    args = parser.parse_args()
    if args.one_process:
        return one_process(args)
    if args.child:
        return print_result((fleet_process if args.child in FLEET else pair_process)(args.child, args))
    settings = {"model": args.model, "latent": args.latent, "steps": args.steps}
    if not args.loaded_vs_compiled:
        rounds = [one_round(FLEET) for _ in range(args.rounds or 2)]
        write_report("cold_start", {**settings, "cfg_batch": 2, "rounds": rounds, "ratios": fleet_summary(rounds)})
        return
    rounds = [one_round(PAIR) for _ in range(args.rounds or 3)]

    def median(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    write_report("loaded_vs_compiled", {**settings, "rounds": rounds, "ratios": {
        key: median("loaded", key) / median("compiled", key) for key in ("median_sampling_s", "cat_us", "fill_us")}})


if __name__ == "__main__":
    main()
