"""The models a benchmark compares, each made from one loaded eager MODEL (ComfyUI's TorchCompileModel, Compile
Model's modes), and what is read around Compile Model's background compile: its wait, Dynamo's compiles, the
largest error of an output against eager's."""
from __future__ import annotations

import time


def load_unet(name: str, cpu: bool = True):
    """ComfyUI imported (`cpu`: on the CPU, else on the device it picks), then the eager MODEL of `name` from its
    diffusion_models folder, as the UNETLoader node loads it."""
    from tools.comfy_env import import_comfyui

    import_comfyui(cpu=cpu)
    import nodes

    return nodes.UNETLoader().load_unet(name, "default")[0]


def variant_model(variant: str, model, pack=None):
    """(the variant's MODEL made from the loaded eager one (a clone sharing its weights), the pack's compile engine
    or None): "core" ComfyUI's TorchCompileModel, "accel" Compile Model's defaults, "accel-compiled" always
    compiled, "accel-lowmem" its low-memory mode, "accel-graphs" the defaults with CUDA graphs (cuda_graphs=True);
    any other name the eager MODEL itself. The "accel" ones load the pack unless given it (load it once a process:
    each load_pack loads it anew)."""
    from tools.comfy_env import load_pack

    if variant == "core":
        from comfy_extras.nodes_torch_compile import TorchCompileModel

        return TorchCompileModel.execute(model, "inductor").result[0], None
    if variant.startswith("accel"):
        engine = (pack or load_pack()).accel.compile
        choose = "always compiled" if variant == "accel-compiled" else "auto"
        mode = "low-memory" if variant == "accel-lowmem" else "default"
        options = engine.CompileOptions(mode=mode, choose=choose, cuda_graphs=variant == "accel-graphs")
        return engine.compile_model(model, options), engine
    return model, None


def wait_for_background(engine, timeout: float | None = None) -> dict | None:
    """Compile Model's background compile, if one runs (choose=auto): wait for it, and say what it took.
    None when nothing compiled in the background."""
    if engine is None:
        return None
    compiler = engine.background.BACKGROUND
    start = time.perf_counter()
    compiler.wait(timeout=timeout)
    jobs = compiler.stats()["finished"]
    if not jobs:
        return None
    return {"wait_after_first_sampling_s": time.perf_counter() - start, "jobs": jobs}


def frames() -> int:
    """The frames Dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def rel_error(out, reference) -> float:
    """The largest difference of `out` from `reference`, relative to the reference's largest value."""
    return ((out.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-12)).item()
