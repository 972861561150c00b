"""One scenario on one model in a fresh process, for bench/report.py: the first prompt (ComfyUI's loaders, the
scenario's nodes, sampling, decoding), then (a cold run) the background compile and the steady state.

    bench/report_child.py SCENARIO FAMILY {cold,warm} OUTPUT_DIR [--quick]

prints one line `RESULT <json>`; the final latent (and image) of the last prompt go to OUTPUT_DIR/<run>.pt.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()

import _path  # noqa: F401, E402  (the project root on sys.path)
from scenarios import BY_NAME, BenchModel, models  # noqa: E402
from tools.harness.child import print_result  # noqa: E402
from tools.harness.memory import peak_mib  # noqa: E402
from tools.harness.sampling import conditioning, sample, synced_clock  # noqa: E402
from tools.harness.variants import frames, rel_error, variant_model, wait_for_background  # noqa: E402

STEADY_PROMPTS = 3  # after the prompt that loads the background child's graphs
# Each steady prompt of a scenario with nodes is followed by the same workflow without them (the loaders' own
# model and VAE) in the same process: a speed ratio that machine-wide drift between processes cannot skew (on the
# 2-core test CPU eager's own steady sampling of the small SD1.5 UNet, 6 steps, varied 0.86 to 1.39 s between
# processes; torch 2.11.0+cu130, ComfyUI 0.3.75, 2026-11-23).


def apply_node(step: str, model, vae, pack):
    """One node of the scenario, called as ComfyUI's executor calls it (its FUNCTION with the widgets' values)."""
    accel = pack.NODE_CLASS_MAPPINGS
    if step == "core_compile":
        return variant_model("core", model)[0], vae
    if step == "core_easycache":  # its defaults: threshold 0.2 from 15% to 95% of the steps
        from comfy_extras.nodes_easycache import EasyCacheNode

        return EasyCacheNode.execute(model, 0.2, 0.15, 0.95, False).result[0], vae
    if step == "compile":  # every default
        return accel["AccelCompileModel"]().apply(model, "default", "auto", "auto")[0], vae
    if step == "deepcache":
        return accel["AccelDeepCache"]().apply(model, 3, 0, 0.0, 1.0, "uniform")[0], vae
    if step == "compile_vae":
        return model, accel["AccelCompileVAE"]().apply(vae, "default")[0]
    raise ValueError(f"unknown scenario node {step!r}")


class Prompt:
    """The workflow after its loaders: sample, then decode (where the model has a VAE here)."""

    def __init__(self, bench: BenchModel, model, vae):
        self.bench, self.model, self.vae = bench, model, vae
        # T5-width prompt states, pooled CLIP-L and guidance as inputs for Flux (cfg 1); CLIP's for SD1.5
        self.conds = conditioning(4096, pooled=True) if bench.family == "flux" else conditioning()

    def run(self, model=None, vae=None) -> dict:
        import nodes

        bench = self.bench
        shape = (1, 16 if bench.family == "flux" else 4, bench.latent, bench.latent)
        sampled = sample(model or self.model, self.conds, shape, bench.steps, bench.cfg)
        decoding = time.perf_counter()  # the sampling's clock waited for the GPU
        vae = vae or self.vae
        image = nodes.VAEDecode().decode(vae, {"samples": sampled.out})[0] if vae is not None else None
        decode_s = synced_clock() - decoding
        return {"sampling_s": sampled.seconds, "decode_s": decode_s, "prompt_s": sampled.seconds + decode_s,
                "step_s": sampled.step_s, "samples": sampled.out, "image": image}


def background(pack) -> dict | None:
    """harness.variants.wait_for_background, summed up for the report."""
    waited = wait_for_background(pack.accel.compile)
    if waited is None:
        return None
    jobs = waited["jobs"]
    return {"wait_s": waited["wait_after_first_sampling_s"], "jobs": len(jobs),
            "kinds": sum(len(job["kinds"]) for job in jobs),
            "child_peak_rss_mib": max(job.get("peak_rss_mib") or 0 for job in jobs)}


def kind_paths(pack) -> dict | None:
    """Which of the pack's compiled kinds auto mode chose compiled per kind and which it kept eager, and its
    whole-call verdicts (a model whose calls were not faster with the compiled blocks runs eagerly whatever its
    kinds chose): a steady speed of a model that runs eagerly is no compile gain. None when the scenario
    compiles nothing."""
    stats = pack.accel.compile.REGISTRY.stats()
    kinds = stats["kinds"]
    if not kinds:
        return None
    paths = {path: sorted({k["kind"] for k in kinds if k["path"] == path}) for path in ("compiled", "eager")}
    paths["verdicts"] = sorted({check["verdict"] for check in stats["whole_call_checks"].values()})
    return paths


def run(scenario_name: str, family: str, phase: str, outputs: Path, quick: bool) -> dict:
    import torch

    from tools.comfy_env import import_comfyui, load_pack

    gpu = torch.cuda.is_available()
    import_comfyui(cpu=not gpu)
    pack = load_pack()
    import nodes

    scenario, bench = BY_NAME[scenario_name], models(quick)[family]
    result = {"scenario": scenario_name, "family": family, "phase": phase,
              "startup_s": time.perf_counter() - STARTED}
    # The first prompt: loaders, the scenario's nodes, sampling, decoding.
    start = time.perf_counter()
    model = nodes.UNETLoader().load_unet(bench.file, "default")[0]
    vae = nodes.VAELoader().load_vae("taesd")[0] if family == "sd15" else None
    plain = (model, vae)  # the loaders' outputs, before the scenario's nodes: eager ComfyUI in this process
    for step in scenario.nodes:
        model, vae = apply_node(step, model, vae, pack)
    prompt = Prompt(bench, model, vae)
    first = prompt.run()
    result["first_prompt_s"] = time.perf_counter() - start
    result["first_sampling_s"] = first["sampling_s"]
    result["first_decode_s"] = first["decode_s"]
    result["compiles_first_prompt"] = frames()
    last = first
    if phase == "cold":
        result["background"] = background(pack)
        loading = prompt.run()  # loads what the background child compiled, makes auto mode's choices
        result["second_prompt_s"] = loading["prompt_s"]
        before = frames()
        steady, eager_here = [], []
        for _ in range(STEADY_PROMPTS):
            steady.append(prompt.run())
            if scenario.nodes:  # the same workflow without the pack's nodes, right after, in this process
                eager_here.append(prompt.run(*plain))
        result["recompiles_steady"] = frames() - before
        result["steady_prompt_s"] = statistics.median(p["prompt_s"] for p in steady)
        result["steady_sampling_s"] = statistics.median(p["sampling_s"] for p in steady)
        if eager_here:
            result["steady_eager_here_prompt_s"] = statistics.median(p["prompt_s"] for p in eager_here)
        result["steady_s_per_step"] = result["steady_sampling_s"] / bench.steps
        last = steady[-1]
        result["kind_paths"] = kind_paths(pack)
        if scenario_name == "swap":
            result.update(swap(prompt, bench, pack))
    result["compiles_total"] = frames()
    result["peak_rss_mib"] = peak_mib()
    if gpu:
        result["peak_gpu_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    torch.save({"samples": last["samples"], "image": last["image"]},
               outputs / f"{family}-{scenario_name}-{phase}.pt")
    return result


def swap(prompt: Prompt, bench: BenchModel, pack) -> dict:
    """Swap Weights to the second file of the architecture: the prompt after the swap (the node, the weight
    copy when the model loads, the sampling), its compiles, and its output against the second file run eagerly
    in this process."""
    import nodes

    # The node as a workflow runs it (UNETLoader -> Compile Model -> Swap Weights): from the prompt it finds the
    # loader's file, so the model's own weights can be re-read from it instead of spilled to disk.
    workflow = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": bench.file, "weight_dtype": "default"}},
                "2": {"class_type": "AccelCompileModel", "inputs": {"model": ["1", 0]}},
                "3": {"class_type": "AccelSwapWeights", "inputs": {"model": ["2", 0], "weights_file": bench.swap_file}}}
    before = frames()
    start = time.perf_counter()
    swapped = pack.NODE_CLASS_MAPPINGS["AccelSwapWeights"]().apply(prompt.model, bench.swap_file, prompt=workflow,
                                                                   unique_id="3")[0]
    after_swap = prompt.run(swapped)
    result = {"swap_prompt_s": time.perf_counter() - start, "swap_recompiles": frames() - before,
              "swap_in_workflow": True}
    eager_b = nodes.UNETLoader().load_unet(bench.swap_file, "default")[0]
    result["swap_max_rel_error_vs_eager"] = rel_error(after_swap["samples"], prompt.run(eager_b)["samples"])
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--quick"]
    print_result(run(*args[:3], Path(args[3]), "--quick" in sys.argv))
