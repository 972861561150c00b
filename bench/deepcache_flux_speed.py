"""DeepCache's speed on a Flux-architecture model at full width, beside core ComfyUI's EasyCache, each alone and with
Compile Model, side by side in one process.

The benchmark Flux (tools/family_models.FLUX_BENCH: hidden 3072, 24 heads, 2 double + 4 single blocks, 1.3 B
parameters; `make models` writes it), sampled by ComfyUI's sampler at cfg 1 (one model call per step), euler,
with T5-width prompt states fed directly. Settings: full compute, EasyCache (its defaults), DeepCache adaptive (its
defaults) and DeepCache at interval 3; then the same with Compile Model (choose "always compiled", so that the
compiled blocks run: on this CPU its auto mode keeps Flux's blocks eager, docs/benchmarks/compile_flux.md). Per
setting: the median seconds of --repeats samplings after one warm-up, the speedup against full compute (eager, and
compiled for the compiled settings), the share of the blocks' compute skipped (block calls counted by forward
pre-hooks in the eager settings) and the speedup that share allows, and the output's error against full compute.
After one warm-up sampling of each setting, the repeats run in rounds over all settings (the machine's speed
drifts over minutes; a round spreads a drift over every setting).

    .venv/bin/python bench/deepcache_flux_speed.py [--steps 20] [--latent 16] [--repeats 3]
"""
from __future__ import annotations

import statistics

import _path  # noqa: F401  (the project root on sys.path)
from digits_flux import BlockWork
from tools.comfy_env import import_comfyui, load_pack
from tools.family_models import FLUX_BENCH
from tools.harness import cli
from tools.harness.results import write_report
from tools.harness.sampling import conditioning, sample


def sample_flux(model, latent: int, steps: int):
    """(output, seconds): the benchmark Flux's sampling at cfg 1, euler, the "simple" scheduler."""
    run = sample(model, conditioning(4096, pooled=True), (1, 16, latent, latent), steps, 1.0, scheduler="simple")
    return run.out, run.seconds


def main() -> None:
    parser = cli.parser(__doc__, steps=20, latent=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="only the settings without Compile Model")
    args = parser.parse_args()

    import_comfyui(cpu=True)
    pack = load_pack()
    import nodes
    import torch
    from comfy_extras.nodes_easycache import EasyCacheNode

    (model,) = nodes.UNETLoader().load_unet(FLUX_BENCH.file_name, "default")
    deepcache = pack.nodes.deepcache.DeepCache()
    caches = {
        "full compute": lambda m: m,
        "EasyCache (defaults)": lambda m: EasyCacheNode.execute(m, 0.2, 0.15, 0.95, False).result[0],
        "DeepCache adaptive (defaults)": lambda m: deepcache.apply(m, 3, 0, 0.0, 1.0, "adaptive")[0],
        "DeepCache interval 3": lambda m: deepcache.apply(m, 3, 0, 0.0, 1.0, "uniform")[0],
    }
    compile_node = pack.nodes.compile_model.CompileModel()
    compiled = compile_node.apply(model, "default", "auto", "auto", "always compiled")[0]
    bases = [("eager", model)] + ([] if args.no_compile else [("Compile Model", compiled)])

    work = BlockWork(model.model.diffusion_model)
    runs = [(base_name, name, cache(base)) for base_name, base in bases for name, cache in caches.items()]
    first, times, works, outputs = {}, {}, {}, {}
    for base_name, name, patched in runs:  # warm-up, one each (Compile Model: its compile)
        first[base_name, name] = sample_flux(patched, args.latent, args.steps)[1]
        print(f"  warm-up {base_name:13s} {name:30s} {first[base_name, name]:6.1f} s", flush=True)
    # Rounds over every setting in turn, not each setting's repeats in a row: this machine's speed drifts over
    # minutes, and a drift must not land on one setting.
    for _ in range(args.repeats):
        for base_name, name, patched in runs:
            work.total = 0.0
            outputs[base_name, name], seconds = sample_flux(patched, args.latent, args.steps)
            times.setdefault((base_name, name), []).append(seconds)
            works[base_name, name] = work.total
    reference = outputs["eager", "full compute"]
    full_seconds = {base_name: statistics.median(times[base_name, "full compute"]) for base_name, _ in bases}
    rows = []
    for base_name, name, _ in runs:
        seconds, out = statistics.median(times[base_name, name]), outputs[base_name, name]
        row = {"base": base_name, "setting": name, "first_seconds": first[base_name, name], "seconds": seconds,
               "runs": times[base_name, name], "speedup_vs_full_eager": full_seconds["eager"] / seconds,
               "speedup_vs_full_same_base": full_seconds[base_name] / seconds,
               "error_vs_full_eager": float((out - reference).abs().max() / reference.abs().max()),
               # hooks count calls of the modules, exact in the eager settings; compiled blocks skip the same
               # calls (the decision is plain Python outside compiled code)
               "block_compute_skipped": 1.0 - works["eager", name] / works["eager", "full compute"]}
        row["speedup_limit"] = 1.0 / (1.0 - row["block_compute_skipped"])
        rows.append(row)
        print(f"  {base_name:13s} {name:30s} {seconds:7.2f} s (first {row['first_seconds']:6.1f} s)  "
              f"x{row['speedup_vs_full_same_base']:.2f} of its base (limit x{row['speedup_limit']:.2f}), "
              f"x{row['speedup_vs_full_eager']:.2f} of eager; error {row['error_vs_full_eager']:.2e}", flush=True)
    work.close()

    print(f"\n| base | setting | median s ({args.steps} steps) | speedup vs full, same base | limit from blocks "
          "skipped | speedup vs full eager | error vs full eager |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['base']} | {r['setting']} | {r['seconds']:.2f} | {r['speedup_vs_full_same_base']:.2f}x | "
              f"{r['speedup_limit']:.2f}x ({100 * r['block_compute_skipped']:.0f}% skipped) | "
              f"{r['speedup_vs_full_eager']:.2f}x | {r['error_vs_full_eager']:.1e} |")
    write_report("deepcache_flux_speed", {"model": FLUX_BENCH.file_name, "steps": args.steps, "latent": args.latent,
                                          "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
                                          "rows": rows})


if __name__ == "__main__":
    main()
