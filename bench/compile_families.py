"""Compile Model on every generated model family (tools/families.py) on whatever device torch sees, in one process
with empty caches: each output against eager's, compiles on the repeat, what it costs (bench/README.md).

    python bench/compile_families.py [--families flux,wan21] [--steps 4] [--scale 2] [--rounds 5 --core]
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools.harness import cli
from tools.harness.child import cache_env
from tools.harness.results import write_report
from tools.harness.sampling import sample
from tools.harness.variants import frames, rel_error, variant_model


def scaled(shape: tuple[int, ...], scale: int) -> tuple[int, ...]:
    """The family's latent with height and width times `scale` (more tokens: a GPU is idle at the test size)."""
    return (*shape[:-2], shape[-2] * scale, shape[-1] * scale)


def timed_sampling(model, family, steps: int, shape) -> tuple[object, float, list[float]]:
    run = sample(model, family.conds(0), shape, steps, family.cfg)
    return run.out, run.seconds, run.step_s


def interleaved(variants: dict, family, steps: int, shape, rounds: int) -> dict:
    """Steady seconds per step of each variant, sampled in turn round after round in this one process (so the
    machine's drift falls on all of them), after one warm-up sampling each; medians, and each one's speed
    against the best of the others and against eager."""
    for model in variants.values():
        timed_sampling(model, family, steps, shape)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, model in variants.items():
            times[name] += timed_sampling(model, family, steps, shape)[2][1:]  # the first step also loads
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"rounds": rounds, "s_per_step": medians,
            "speed_vs_eager": {name: medians["eager"] / m for name, m in medians.items()},
            "defaults_vs_best": min(medians.values()) / medians["defaults"]}


def run_family(engine, nodes, family, steps: int, shape, rounds: int = 0, core: bool = False) -> dict:
    (model,) = nodes.UNETLoader().load_unet(family.file_name, "default")
    result = {"family": family.name, "latent": list(shape), "dtype": str(model.model.get_dtype())}
    eager_first, result["eager_first_s"], _ = timed_sampling(model, family, steps, shape)
    eager, _, times = timed_sampling(model, family, steps, shape)
    result["eager_s_per_step"] = statistics.median(times[1:] or times)
    result["eager_repeat_error"] = rel_error(eager, eager_first)  # the device's own run-to-run noise

    auto = engine.compile_model(model, engine.CompileOptions())
    before = frames()
    out, result["auto_first_s"], _ = timed_sampling(auto, family, steps, shape)
    result["auto_first_compiles"] = frames() - before
    result["auto_first_error"] = rel_error(out, eager)
    start = time.perf_counter()
    engine.background.BACKGROUND.wait(timeout=1200)
    result["background_wait_s"] = time.perf_counter() - start
    out, result["auto_loading_s"], _ = timed_sampling(auto, family, steps, shape)
    result["auto_loading_error"] = rel_error(out, eager)
    out, _, times = timed_sampling(auto, family, steps, shape)
    out, _, more = timed_sampling(auto, family, steps, shape)
    result["auto_s_per_step"] = statistics.median(times[1:] + more[1:] or times)
    result["auto_error"] = rel_error(out, eager)

    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    before = frames()
    out, result["always_first_s"], _ = timed_sampling(always, family, steps, shape)
    result["always_first_compiles"] = frames() - before
    result["always_first_error"] = rel_error(out, eager)
    before = frames()
    out, _, times = timed_sampling(always, family, steps, shape)
    timed_sampling(auto, family, steps, shape)
    result["repeat_compiles"] = frames() - before
    result["always_s_per_step"] = statistics.median(times[1:] or times)
    result["always_error"] = rel_error(out, eager)

    if rounds:
        result["interleaved"] = interleaved({"eager": model, "defaults": auto, "always compiled": always,
                                             **({"core": variant_model("core", model)[0]} if core else {})},
                                            family, steps, shape, rounds)
    kinds = {e.key: e.stats() for record in engine.model_record.records_of(model.model)
             if record.options.choose == "auto" for e in record.entries}
    result["auto_kinds"] = [{k: kind.get(k) for k in ("kind", "path", "reason", "call_share")} |
                            {"background": kind["background"]["state"]} for kind in kinds.values()]
    result["whole_call_checks"] = [{k: c.get(k) for k in ("verdict", "reason", "calls_timed")}
                                   for c in engine.REGISTRY.stats()["whole_call_checks"].values()]
    return result


def bench_flux_case():
    """The benchmark Flux as a family case: the generated Flux's conditioning and latent, the benchmark's file."""
    from tools.families import FamilyCase
    from tools.family_models import FLUX_BENCH

    class BenchFlux(FamilyCase):
        @property
        def file_name(self) -> str:
            return FLUX_BENCH.file_name

    return BenchFlux


def main() -> None:
    parser = cli.parser(__doc__, steps=4)
    parser.add_argument("--families", help="comma-separated names (default: every family)")
    parser.add_argument("--scale", type=int, default=1, help="latent height and width times this")
    parser.add_argument("--rounds", type=int, default=0,
                        help="then this many interleaved rounds of eager, the defaults and always compiled")
    parser.add_argument("--core", action="store_true", help="with --rounds: core TorchCompileModel too")
    args = parser.parse_args()

    os.environ.update(cache_env(Path(tempfile.mkdtemp(prefix="accel-bench-families-")), {}))
    import torch

    from tools.comfy_env import import_comfyui, load_pack

    from tools.families import BY_FAMILY, FAMILIES

    import_comfyui(cpu=not torch.cuda.is_available())
    import nodes

    engine = load_pack().accel.compile
    wanted = args.families.split(",") if args.families else [f.name for f in FAMILIES]
    results = []
    bench_flux = bench_flux_case()(**{**vars(BY_FAMILY["flux"]), "name": "flux-bench"})
    for family in (*FAMILIES, bench_flux):
        if family.name not in wanted:
            continue
        try:
            results.append(run_family(engine, nodes, family, args.steps, scaled(family.latent_shape, args.scale),
                                      args.rounds, args.core))
        except Exception as error:  # one family's failure is a result too; the others still run
            results.append({"family": family.name, "failed": f"{type(error).__name__}: {error}"[:2000]})
        print(json.dumps(results[-1]), flush=True)
    write_report("compile_families", {"steps": args.steps, "scale": args.scale, "results": results})
    print_table(results)


def print_table(results: list[dict]) -> None:
    columns = ("family", "eager_first_s", "auto_first_s", "background_wait_s", "always_first_s",
               "eager_s_per_step", "auto_s_per_step", "always_s_per_step", "repeat_compiles",
               "auto_first_error", "auto_error", "always_error", "eager_repeat_error")
    print(" | ".join(columns))
    for r in results:
        if "failed" in r:
            print(f"{r['family']} | FAILED: {r['failed'][:300]}")
            continue
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in columns))
        print("    auto paths: " + ", ".join(f"{k['kind']}={k['path']}" for k in r["auto_kinds"]))
        if "interleaved" in r:
            steady = r["interleaved"]
            print(f"    interleaved ({steady['rounds']} rounds), x eager: " + ", ".join(
                f"{name} {speed:.3f}" for name, speed in steady["speed_vs_eager"].items()) +
                f"; the defaults at {steady['defaults_vs_best']:.3f}x the best")


if __name__ == "__main__":
    main()
