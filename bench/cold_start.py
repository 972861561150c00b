"""Cold start with the defaults: the child's hand-over, a warm restart and a new fleet worker (#33).

Compile Model with its defaults (choose auto, background compile), so each kind is compiled by a child process
and saved whole as a precompiled function (accel/compile/precompiled.py). Each round runs three fresh processes
in turn, one local cache directory shared by the first two and one Redis store (tools/redis_server.py) shared by
all three:
- "first": empty cache and store. Prompt 1 runs eagerly while the child compiles; once the background work is
  done, prompt 2 is its first compiled prompt (it loads the precompiled functions: the hand-over);
- "restart": the first's cache. Prompt 1 runs eagerly while inductor's CPU checks run (a thread, at an idle
  moment); then its first compiled prompt;
- "worker": an empty local cache, the store: the same as a new fleet worker.
Every process also times eager prompts of the same model, interleaved with its compiled prompts after the first,
so each ratio is to its own eager. Reported per process: Dynamo frames and compile seconds in the process, the
child's wall seconds, the precompiled functions' load seconds, each prompt's seconds, and the outputs' hash (a new
worker's must equal the first's). Medians over rounds.

    .venv/bin/python bench/cold_start.py [--rounds 2] [--model accel-sd15-small.safetensors] [--steps 4]
"""
from __future__ import annotations

import hashlib
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

SECRET = "bench-fleet-secret-0123456789"


def run_process(side: str, model_name: str, steps: int, latent: int) -> dict:
    from tools.comfy_env import import_comfyui, load_pack

    import_comfyui(cpu=True)
    import nodes
    from torch._dynamo.utils import counters

    engine = load_pack().accel.compile
    (model,) = nodes.UNETLoader().load_unet(model_name, "default")
    compiled = engine.compile_model(model, engine.CompileOptions())
    conds = conditioning()

    def prompt(patcher):
        run = sample(patcher, conds, (1, 4, latent, latent), steps, 7.0)
        return run.seconds, run.out

    eager_first, _ = prompt(model)
    first_s, _ = prompt(compiled)  # eagerly, while the child compiles (or the CPU checks run)
    wait_start = time.perf_counter()
    engine.background.BACKGROUND.wait(timeout=1800)
    waited = time.perf_counter() - wait_start
    frames = counters["frames"]["ok"]
    handover_s, _ = prompt(compiled)  # the first compiled prompt: loads the precompiled functions
    eager_s, compiled_s = [], []
    for _ in range(3):  # interleaved: the machine's drift falls on both
        eager_s.append(prompt(model)[0])
        compiled_s.append(prompt(compiled)[0])
    stats = engine.REGISTRY.stats()
    frames_at_end = counters["frames"]["ok"]
    # The outputs compared across processes: auto mode times some calls eagerly, and which ones depends on the
    # machine's noise, so the comparison goes through an always-compiled clone (the same kinds and graphs).
    _, out = prompt(engine.compile_model(model, engine.CompileOptions(choose="always compiled")))
    kinds = [k for k in stats["kinds"] if k["precompiled"]["functions"]]
    env = stats["compile_cache"]["environments"][0]
    return {"side": side, "eager_first_prompt_s": eager_first, "first_prompt_s": first_s, "waited_s": waited,
            "first_compiled_prompt_s": handover_s, "eager_s": eager_s, "compiled_s": compiled_s,
            "dynamo_frames": frames_at_end, "frames_from_first_compiled_prompt": frames_at_end - frames,
            "compile_seconds_in_process": stats["totals"]["compile_seconds"],
            "child_jobs": [{"wall_s": j["wall_seconds"], "cold_graphs": j["cold_graphs"]}
                           for j in stats["background"]["finished"]],
            "cpu_checks_s": stats["background"]["cpu_checks"]["seconds"],
            "kinds_precompiled": len(kinds), "precompiled_functions": sum(k["precompiled"]["functions"] for k in kinds),
            "precompiled_load_s": sum(k["precompiled"]["load_seconds"] for k in kinds),
            "precompiled_from_remote": env.get("precompiled_from_remote", 0),
            "output_sha256": hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]}


def one_round(model: str, steps: int, latent: int) -> dict:
    from tools.redis_server import RedisServer

    args = ["--model", model, "--steps", str(steps), "--latent", str(latent)]
    with tempfile.TemporaryDirectory(prefix="accel-bench-cold-") as tmp, RedisServer(Path(tmp) / "redis") as redis:
        store = {"ACCEL_REMOTE_CACHE": redis.url, "ACCEL_REMOTE_CACHE_KEY": SECRET}
        found = {}
        for side, cache in (("first", "a"), ("restart", "a"), ("worker", "b")):
            found[side] = run_result_process([sys.executable, __file__, "--child", side, *args],
                                             {**cache_env(Path(tmp) / cache), **store}, side)
            print(json.dumps(found[side]), flush=True)
    return found


def summary(rounds: list[dict]) -> dict:
    def med(values):
        return round(statistics.median(values), 3)

    out = {}
    for side in ("first", "restart", "worker"):
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
    parser = cli.parser(__doc__, child=True, model="accel-sd15-small.safetensors", steps=4, latent=32, rounds=2)
    args = parser.parse_args()
    if args.child:
        return print_result(run_process(args.child, args.model, args.steps, args.latent))
    rounds = [one_round(args.model, args.steps, args.latent) for _ in range(args.rounds)]
    write_report("cold_start", {"model": args.model, "latent": args.latent, "cfg_batch": 2, "steps": args.steps,
                                "rounds": rounds, "ratios": summary(rounds)})


if __name__ == "__main__":
    main()
