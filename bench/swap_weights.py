"""Swap Weights against stock ComfyUI switching checkpoints on a compiled model, each variant in a fresh process:
the read-and-copy floor, stock, Swap Weights with the model's file known and with it unknown (bench/README.md).

    .venv/bin/python bench/swap_weights.py [--steps 2] [--latent 16] [--variants read-copy,stock,accel,accel-spill]
    # smoke run on the small test models:
    .venv/bin/python bench/swap_weights.py --a accel-sd15-small.safetensors --b accel-sd15-small-b.safetensors
"""
from __future__ import annotations

import time

import _path  # noqa: F401  (the project root on sys.path)
from tools.comfy_env import load_pack
from tools.harness import cli
from tools.harness.child import print_result, run_variants
from tools.harness.memory import peak_mib, reset_peak, rss_mib
from tools.harness.results import write_report
from tools.harness.sampling import conditioning, sample
from tools.harness.variants import frames, load_unet, variant_model

VARIANTS = ("read-copy", "stock", "accel", "accel-spill")


def run_variant(variant: str, name_a: str, name_b: str, steps: int, latent: int) -> dict:
    """Inside the variant's own process."""
    model_a = load_unet(name_a)
    import comfy.model_management
    import comfy.utils
    import folder_paths
    import nodes

    conds = conditioning()

    def sample_s(model) -> float:
        return sample(model, conds, (1, 4, latent, latent), steps, 7.0).seconds

    result = {"variant": variant}
    if variant == "read-copy":
        comfy.model_management.load_models_gpu([model_a])
        result["steady_rss_mib"] = rss_mib()
        reset_peak()
        start = time.perf_counter()
        import safetensors

        prefix = "model.diffusion_model."
        with safetensors.safe_open(folder_paths.get_full_path("diffusion_models", name_b), "pt") as f:
            for key in f.keys():
                module_key = "diffusion_model." + (key[len(prefix):] if key.startswith(prefix) else key)
                comfy.utils.copy_to_param(model_a.model, module_key, f.get_tensor(key))
        result["read_copy_s"] = time.perf_counter() - start
        result["peak_rss_during_mib"] = peak_mib()
        return result

    pack = None if variant == "stock" else load_pack()  # stock ComfyUI does not load the pack
    compiled = "core" if variant == "stock" else "accel-compiled"
    model_a = variant_model(compiled, model_a, pack)[0]
    result["first_sample_a_s"] = sample_s(model_a)  # compiles
    result["steady_sample_s"] = sample_s(model_a)
    result["steady_rss_mib"] = rss_mib()
    before = frames()

    reset_peak()
    start = time.perf_counter()
    if variant == "stock":
        model_b = variant_model(compiled, nodes.UNETLoader().load_unet(name_b, "default")[0])[0]
    else:
        workflow = {  # what ComfyUI passes the node as its hidden PROMPT input
            "1": {"class_type": "UNETLoader", "inputs": {"unet_name": name_a, "weight_dtype": "default"}},
            "2": {"class_type": "AccelCompileModel", "inputs": {"model": ["1", 0]}},
            "3": {"class_type": "AccelSwapWeights", "inputs": {"model": ["2", 0], "weights_file": name_b}},
        }
        node = pack.nodes.swap_weights.SwapWeights()
        model_b = node.apply(model_a, name_b, prompt=workflow if variant == "accel" else None, unique_id="3")[0]
    comfy.model_management.load_models_gpu([model_b])
    result["switch_load_s"] = time.perf_counter() - start
    result["first_sample_b_s"] = sample_s(model_b)
    result["switch_total_s"] = time.perf_counter() - start
    result["compiles_during_switch"] = frames() - before
    result["peak_rss_during_mib"] = peak_mib()
    result["rss_after_mib"] = rss_mib()
    result["steady_sample_b_s"] = sample_s(model_b)
    if variant != "stock":
        swaps = [e for e in pack.accel.telemetry.snapshot()["events"] if e["action"] == "swapped"]
        result["swap"] = {k: swaps[-1][k] for k in ("seconds", "tensors", "bytes", "spilled", "origin")}
        # and back: the input model again (ComfyUI restores A's weights from the file, or the spill)
        reset_peak()
        start = time.perf_counter()
        comfy.model_management.load_models_gpu([model_a])
        result["back_to_a_load_s"] = time.perf_counter() - start
        result["back_peak_rss_mib"] = peak_mib()
        result["back_rss_after_mib"] = rss_mib()
        result["compiles_during_switch_and_back"] = frames() - before
    return result


def ratios(by: dict) -> dict:
    out = {}
    accel, stock, floor = by.get("accel"), by.get("stock"), by.get("read-copy")
    for name, run in by.items():
        if "peak_rss_during_mib" in run and "steady_rss_mib" in run and name != "read-copy":
            out[f"{name}_peak_rss_vs_steady"] = run["peak_rss_during_mib"] / run["steady_rss_mib"]
            out[f"{name}_rss_after_vs_steady"] = run["rss_after_mib"] / run["steady_rss_mib"]
    if accel and floor:
        out["accel_swap_load_vs_read_copy"] = accel["switch_load_s"] / floor["read_copy_s"]  # target <= 1.5
    if accel and stock:
        out["accel_switch_vs_stock_switch"] = accel["switch_total_s"] / stock["switch_total_s"]  # target <= 1.0
    if by.get("accel-spill") and floor:
        out["accel_spill_swap_load_vs_read_copy"] = by["accel-spill"]["switch_load_s"] / floor["read_copy_s"]
    return out


def main() -> None:
    parser = cli.parser(__doc__, child=True, steps=2, latent=16, variants=",".join(VARIANTS))
    parser.add_argument("--a", default="accel-sd15-a.safetensors")
    parser.add_argument("--b", default="accel-sd15-b.safetensors")
    args = parser.parse_args()
    if args.child:
        return print_result(run_variant(args.child, args.a, args.b, args.steps, args.latent))

    results = run_variants(__file__, args.variants.split(","))

    write_report("swap_weights", {"a": args.a, "b": args.b, "latent": args.latent, "cfg_batch": 2,
                                  "steps": args.steps, "results": results,
                                  "ratios": ratios({r["variant"]: r for r in results})})


if __name__ == "__main__":
    main()
