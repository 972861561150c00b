"""Peak memory at video scale: Compile Model, DeepCache and both against eager, each in a fresh process, on the
trained video Wan with a latent of real proportions (832x480 pixels, 33 frames; bench/README.md).

    .venv/bin/python bench/video_memory.py [--steps 3] [--frames 33] [--width 832] [--height 480]
"""
from __future__ import annotations

import _path  # noqa: F401  (the project root on sys.path)
from tools.comfy_env import ROOT
from tools.harness import cli
from tools.harness.child import print_result, run_variants
from tools.harness.memory import peak_mib
from tools.harness.results import markdown_table, write_report
from tools.harness.sampling import conditioning, sample
from tools.harness.variants import load_unet, variant_model

SCENARIOS = ("eager", "compile", "deepcache", "compile+deepcache")
TRAINED = ROOT / "bench" / "assets" / "digits_wan21.safetensors"  # bench/deepcache_quality.py --model wan trained it
BOUND = 1.05


def latent_shape(width: int, height: int, frames: int) -> tuple[int, ...]:
    """Wan 2.1's latent of a clip: 16 channels, a frame per 4 (plus the first), 8x smaller in height and width."""
    return (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)


def run_scenario(scenario: str, args) -> dict:
    from tools.comfy_env import load_pack

    pack = load_pack()
    import folder_paths

    folder_paths.add_model_folder_path("diffusion_models", str(TRAINED.parent))
    model = load_unet(TRAINED.name)
    if "compile" in scenario:
        model = variant_model("accel", model, pack)[0]
    if "deepcache" in scenario:
        (model,) = pack.nodes.deepcache.DeepCache().apply(model, 3, 0, 0.0, 1.0, "uniform")
    shape = latent_shape(args.width, args.height, args.frames)
    conds = conditioning(4096)
    first = sample(model, conds, shape, args.steps, 5.0).seconds
    background = pack.accel.compile.background.BACKGROUND
    background.wait(timeout=1800)
    second = sample(model, conds, shape, args.steps, 5.0).seconds
    children = [job.get("peak_rss_mib") for job in background.stats()["finished"]]
    return {"scenario": scenario, "model": TRAINED.name, "latent": list(shape), "first_s": round(first, 2),
            "second_s": round(second, 2), "peak_rss_mib": round(peak_mib()), "child_peak_rss_mib": children}


def main() -> None:
    parser = cli.parser(__doc__, child=True, steps=3)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    if args.child:
        return print_result(run_scenario(args.child, args))
    results = run_variants(__file__, args.scenarios.split(","))
    eager = next(r for r in results if r["scenario"] == "eager")["peak_rss_mib"]
    ratios = {r["scenario"]: round(r["peak_rss_mib"] / eager, 3) for r in results}
    write_report("video_memory", {"settings": vars(args), "results": results, "ratios": ratios})
    print("", *markdown_table(
        ["scenario", "peak RSS MiB", "x eager", "first sampling s", "second s", "child's peak RSS MiB"],
        [[r["scenario"], r["peak_rss_mib"], f"{ratios[r['scenario']]:.3f}", r["first_s"], r["second_s"],
          ", ".join(map(str, r["child_peak_rss_mib"])) or "-"] for r in results]), sep="\n")
    over = [s for s, ratio in ratios.items() if ratio > BOUND]
    print(f"\nbound {BOUND}x eager's peak RSS: " + (f"over for {', '.join(over)}" if over else "met by every scenario"))


if __name__ == "__main__":
    main()
