"""Steady sampling through precompiled functions against the same kinds through Dynamo, in one process.

The small SD1.5 UNet with Compile Model's defaults: its child compiles the kinds and saves them whole
(accel/compile/precompiled.py), this process loads them; then an "always compiled" clone samples, alternately
served by those precompiled functions and, with them set aside, by Dynamo's own graphs of the same kinds (compiled
here from torch's caches), with eager samplings in between: one process, interleaved rounds, so the machine's
drift falls on every side. Prints the medians.

    ACCEL_CACHE_DIR=/tmp/some-empty-dir .venv/bin/python bench/precompiled_vs_dynamo.py [--rounds 6]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--model", default="accel-sd15-small.safetensors")
    args = parser.parse_args()
    from tools.comfy_env import import_comfyui, load_pack

    import_comfyui(cpu=True)
    import comfy.sample
    import nodes
    import torch

    engine = load_pack().accel.compile
    (model,) = nodes.UNETLoader().load_unet(args.model, "default")
    context = torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(0))
    latent = torch.zeros(1, 4, 32, 32)

    def sample(patcher) -> float:
        start = time.perf_counter()
        comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent, 0), 4, 7.0, "euler", "normal",
                            [[context, {}]], [[torch.zeros_like(context), {}]], latent, disable_pbar=True, seed=0)
        return time.perf_counter() - start

    defaults = engine.compile_model(model, engine.CompileOptions())
    sample(defaults)
    engine.background.BACKGROUND.wait(timeout=900)
    sample(defaults)
    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    sample(always)
    entries = list(engine.REGISTRY._entries.values())
    saved = {id(e): e.precompiled.functions for e in entries}

    def serve_precompiled(yes: bool) -> None:
        for entry in entries:
            entry.precompiled.functions = saved[id(entry)] if yes else {}

    serve_precompiled(False)
    sample(always)  # Dynamo makes its graphs of the same kinds (from torch's caches)
    times = {"precompiled": [], "dynamo": [], "eager": []}
    for _ in range(args.rounds):
        serve_precompiled(True)
        times["precompiled"].append(sample(always))
        serve_precompiled(False)
        times["dynamo"].append(sample(always))
        times["eager"].append(sample(model))
    medians = {side: statistics.median(values) for side, values in times.items()}
    for side, values in times.items():
        print(f"{side}: median {medians[side]:.3f} s {[round(v, 3) for v in values]}")
    print(f"precompiled / dynamo: {medians['precompiled'] / medians['dynamo']:.3f}")
    print("kinds (label, Dynamo frames, precompiled calls):",
          [(e.kind.label, e.compiles, e.precompiled.calls) for e in entries])


if __name__ == "__main__":
    main()
