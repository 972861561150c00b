"""A fleet compiles once (#17): N = 1, 2, 4 ComfyUI workers started one after another, each with an empty local
compile cache, against one Redis (ACCEL_REMOTE_CACHE), beside the same workers with no store (bench/README.md).

    python bench/fleet_cache.py [--out docs/benchmarks/fleet_cache.md] [--counts 1,2,4] [--model sd3]
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools.comfy_env import ROOT
from tools.harness import cli
from tools.harness.results import results_path

SECRET = "bench-fleet-secret-0123456789"
MODEL_TEXT = {"sd3": "the generated SD3 transformer (one block kind), 3 steps, cfg 4.5",
              "sd15": "the small SD1.5 UNet (several block kinds), 128x128, 6 steps, cfg 7"}


MODELS = {"sd3": dict(model="sd3", cfg=4.5, steps=3),  # the generated SD3 transformer: one block kind
          "sd15": dict(model="sd15", size=128, steps=6)}  # the small SD1.5 UNet: several kinds, a longer compile


def first_prompt(base: Path, env: dict, model: str) -> tuple[object, dict]:
    """Start a worker, time its first compiled prompt, read what it compiled and its latent, stop it."""
    from tools.soak_prompts import Prompt, graph_of, saved_latent, server_of

    prompt = Prompt(model, compiled=True, choose="always compiled", background=False, **MODELS[model])
    started = time.perf_counter()
    with server_of(base, env=env, api_nodes=True) as server:
        ready = time.perf_counter()
        queued = time.perf_counter()
        server.wait_for(server.queue_prompt(graph_of(prompt, "first")), timeout=900)
        latency = time.perf_counter() - queued
        latent = saved_latent(server, "first")
        stats = server.get_json("/accel/stats")["compile"]
        # a worker stays up after its prompt: what it compiled there is saved whole by a child meanwhile
        # (ACCEL_SAVE_COMPILES), published to the store for the next worker
        saves = server.wait_for_background()["finished"]
        env_after = next(e for e in server.get_json("/accel/stats")["compile"]["compile_cache"]["environments"]
                         if e["fingerprint"]["device"] == "cpu")
        env_stats = next(e for e in stats["compile_cache"]["environments"] if e["fingerprint"]["device"] == "cpu")
        row = {"server_start_s": round(ready - started, 2), "first_prompt_s": round(latency, 2),
               "compile_seconds": stats["totals"]["compile_seconds"],
               "cold_compiles": stats["totals"]["disk_cache"].get("fx_graph_misses", 0),
               "fx_graph_hits": stats["totals"]["disk_cache"].get("fx_graph_hits", 0),
               "artifacts_from_remote": env_stats["artifacts_from_remote"],
               "published": (env_stats["remote"] or {}).get("remote_published", 0),
               "torch_remote_hits": (env_stats["remote"] or {}).get("torch_hits", 0),
               "torch_published": (env_stats["remote"] or {}).get("torch_published", 0),
               "saves": len(saves), "precompiled_from_remote": env_stats.get("precompiled_from_remote", 0),
               "published_after_save": (env_after["remote"] or {}).get("remote_published", 0)}
        return latent, row


def fleet(count: int, store: bool, base: Path, model: str) -> list[dict]:
    from tools.redis_server import RedisServer

    redis = RedisServer(base / "redis").start() if store else None
    try:
        env = {"ACCEL_REMOTE_CACHE": redis.url, "ACCEL_REMOTE_CACHE_KEY": SECRET} if redis else {}
        rows, first_latent = [], None
        for worker in range(count):
            latent, row = first_prompt(base / f"worker-{worker}", env, model)
            first_latent = latent if first_latent is None else first_latent
            rows.append({"model": model, "workers": count, "store": store, "worker": worker + 1, **row,
                         "equals_first_worker": bool((latent == first_latent).all())})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        if redis:
            redis.stop()


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "fleet_cache.md")
    parser.add_argument("--counts", default="1,2,4")
    parser.add_argument("--model", choices=sorted(MODELS), default="sd3")
    args = parser.parse_args()

    import torch
    from tools.comfy_env import comfyui_dir, comfyui_version
    from tools.harness.machine import cpu_model

    counts = [int(c) for c in args.counts.split(",")]
    rows = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="accel-fleet-") as tmp:
        for count in counts:
            for store in (False, True):
                rows += fleet(count, store, Path(tmp) / f"n{count}-{'store' if store else 'alone'}", args.model)
    minutes = (time.time() - started) / 60

    lines = [
        "# A fleet compiles once: the compile cache on a shared Redis",
        "",
        f"`bench/fleet_cache.py`, one run, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{minutes:.0f} min. Machine: {cpu_model()}, no GPU; torch {torch.__version__}, ComfyUI "
        f"{comfyui_version(comfyui_dir())}, Debian's redis-server on the same machine (loopback).",
        "",
        "Each worker is a started ComfyUI server with an empty local compile cache. Its first prompt: "
        f"{MODEL_TEXT[args.model]}, through Compile Model with `choose` \"always compiled\" and the background "
        "compile off, so whatever the worker compiles is in that prompt's path. After its prompt a worker stays up "
        "until its background work is done (what it compiled is saved whole by a child: ACCEL_SAVE_COMPILES), then "
        "stops. The workers of one group run one after another; with the store, a fresh Redis per group.",
        "",
        "| workers | store | worker | first prompt (s) | compile s (pack) | cold compiles (FX misses) | "
        "FX hits | artifacts from store | precompiled from store | saves after the prompt | "
        "torch entries from store / published | server start (s) | latent = worker 1's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['workers']} | {'Redis' if r['store'] else 'none'} | {r['worker']} | "
                     f"{r['first_prompt_s']:.1f} | {r['compile_seconds']:.1f} | {r['cold_compiles']} | "
                     f"{r['fx_graph_hits']} | {r['artifacts_from_remote']} | {r['precompiled_from_remote']} | "
                     f"{r['saves']} | {r['torch_remote_hits']} / {r['torch_published']} | {r['server_start_s']:.1f} | "
                     f"{'bit-equal' if r['equals_first_worker'] else 'differs'} |")
    lines += ["", "Per group, the sum over its workers:", "",
              "| workers | store | first prompts, summed (s) | compile s, summed | cold compiles, summed | "
              "median first prompt after the first worker (s) |", "| --- | --- | --- | --- | --- | --- |"]
    for count in counts:
        for store in (False, True):
            group = [r for r in rows if r["workers"] == count and r["store"] == store]
            later = [r["first_prompt_s"] for r in group[1:]]
            lines.append(f"| {count} | {'Redis' if store else 'none'} | "
                         f"{sum(r['first_prompt_s'] for r in group):.1f} | "
                         f"{sum(r['compile_seconds'] for r in group):.1f} | {sum(r['cold_compiles'] for r in group)} | "
                         f"{f'{statistics.median(later):.1f}' if later else '-'} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    results_path(f"fleet_cache_{args.model}.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
