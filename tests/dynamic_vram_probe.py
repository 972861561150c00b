"""Run in a fresh process by test_dynamic_vram.py (ComfyUI 0.33+): the pack's features on a real ModelPatcherDynamic.

    python tests/dynamic_vram_probe.py

A fresh process because comfy-aimdo's library must be loaded before ComfyUI is imported, as ComfyUI's main.py does
on a default install (`comfy_aimdo.control.init()` first: comfy_aimdo.host_buffer binds the library when it is
imported, and every ModelPatcherDynamic makes host buffers). What a CPU cannot do: aimdo's devices
(`control.init_devices`) need a CUDA driver, so no VBAR is made and a dynamic model cannot load or fault weights in;
and ModelPatcherDynamic sends a CPU load device to a plain ModelPatcher. So the dynamic patchers here name the CUDA
device a GPU machine would have (nothing loads to it) and their weights stay where ComfyUI's loader put them: the
pack's decisions (clones, delegates, status lines, the eager path) and the model's forward run for real.

Prints one `RESULT <json>` line of facts the test asserts on.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "tests"))

import comfy_aimdo.control  # noqa: E402

AIMDO_LOADED = comfy_aimdo.control.init()  # main.py's first step on a default install (no GPU needed for it)

from tools.comfy_env import import_comfyui, load_pack  # noqa: E402
from tools.harness.child import print_result  # noqa: E402


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main() -> None:
    import_comfyui(cpu=True)
    import comfy.model_patcher
    import comfy.model_prefetch
    import comfy.patcher_extension
    import comfy.sd
    import folder_paths
    import torch
    from compile_helpers import SMALL, SMALL_B, apply_model
    from torch._dynamo.utils import counters

    pack = load_pack(as_in_a_server=True).accel
    warnings = Warnings()
    logging.getLogger("comfyui_accel").addHandler(warnings)
    facts: dict = {"aimdo_loaded": AIMDO_LOADED, "aimdo_devices": comfy_aimdo.control.init_devices([0])}
    cuda = torch.device("cuda", 0)  # named, never used: nothing here loads the model

    def dynamic(patcher, with_loader: bool):
        """A ModelPatcherDynamic of `patcher`'s model, as a 0.33 loader on NVIDIA returns it: its
        cached_patcher_init (the loader to replay) when `with_loader`, none as from a custom loader."""
        made = comfy.model_patcher.ModelPatcherDynamic(patcher.model, load_device=cuda,
                                                       offload_device=torch.device("cpu"))
        made.cached_patcher_init = patcher.cached_patcher_init if with_loader else None
        return made

    facts["cpu_load_device_reroutes"] = type(comfy.model_patcher.ModelPatcherDynamic(
        torch.nn.Linear(1, 1), load_device=torch.device("cpu"), offload_device=torch.device("cpu"))).__name__

    path = folder_paths.get_full_path("diffusion_models", SMALL)
    loaded = comfy.sd.load_diffusion_model(path)  # sets cached_patcher_init, as UNETLoader does
    dyn = dynamic(loaded, with_loader=True)
    facts["built"] = {"type": type(dyn).__name__, "is_dynamic": dyn.is_dynamic(),
                      "clone_type": type(dyn.clone()).__name__}

    # Compile Model: leaves dynamic VRAM through the delegate, reused by a second application.
    options = pack.compile.CompileOptions()
    first = pack.compile.compile_model(dyn, options, owner="dyn-left")
    second = pack.compile.compile_model(dyn, options, owner="dyn-left-2")
    status = pack.compile.status.owner_statuses()["dyn-left"]
    eager_input = apply_model(loaded)
    facts["compile_left"] = {
        "type": type(first).__name__, "is_dynamic": first.is_dynamic(), "same_model_as_input": first.model is dyn.model,
        "second_same_model": second.model is first.model, "delegate_cached": dyn.non_dynamic_delegate_model is not None,
        "has_wrapper": bool(first.get_wrappers(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "accel.compile_model")),
        "status": status, "reloaded_output_equal": torch.equal(apply_model(_plain(first)), eager_input)}

    # Compile Model on a dynamic model with no loader to replay: stays dynamic, runs eagerly, one warning.
    stuck = dynamic(comfy.sd.load_diffusion_model(path), with_loader=False)  # a model of its own: its records
    before = len(warnings.messages)
    kept = pack.compile.compile_model(stuck, options, owner="dyn-kept")
    kept.pre_run()  # ComfyUI's own step before sampling: the model's current patcher is this dynamic one
    frames = counters["frames"]["ok"]
    outputs = [apply_model(kept) for _ in range(2)]
    facts["compile_kept"] = {
        "type": type(kept).__name__, "is_dynamic": kept.is_dynamic(), "same_model_as_input": kept.model is stuck.model,
        "equal_to_eager": all(torch.equal(out, eager_input) for out in outputs),
        "dynamo_frames": counters["frames"]["ok"] - frames,
        "warnings": [m for m in warnings.messages[before:] if "dynamic VRAM" in m],
        "status": pack.compile.status.owner_statuses()["dyn-kept"]}

    # A regular clone made dynamic after Compile Model's own apply (its current patcher dynamic at the call):
    # never traced under aimdo's casts either, one warning of its own.
    late = pack.compile.compile_model(comfy.sd.load_diffusion_model(path), options, owner="dyn-late")
    late_dynamic = comfy.model_patcher.ModelPatcherDynamic(late.model, load_device=cuda, offload_device=torch.device("cpu"))
    late_dynamic.wrappers = late.wrappers
    late_dynamic.pre_run()
    before = len(warnings.messages)
    frames = counters["frames"]["ok"]
    out = apply_model(late_dynamic)
    facts["compile_running_dynamic"] = {
        "equal_to_eager": torch.equal(out, eager_input), "dynamo_frames": counters["frames"]["ok"] - frames,
        "warnings": [m for m in warnings.messages[before:] if "dynamic VRAM" in m],
        "status": pack.compile.status.owner_statuses()["dyn-late"]}

    # DeepCache keeps dynamic VRAM.
    cached, _, message = pack.deepcache.apply(dyn, pack.deepcache.DeepCacheConfig())
    facts["deepcache"] = {"type": type(cached).__name__, "is_dynamic": cached.is_dynamic(),
                          "same_model_as_input": cached.model is dyn.model, "message": message}

    # Swap Weights leaves it, or refuses naming the fix.
    source = pack.weight_swap.sources.WeightsFile(folder_paths.get_full_path("diffusion_models", SMALL_B))
    swapped = pack.weight_swap.swap_weights(dyn, source)
    facts["swap_left"] = {"type": type(swapped).__name__, "is_dynamic": swapped.is_dynamic(),
                          "same_model_as_input": swapped.model is dyn.model}
    try:
        pack.weight_swap.swap_weights(stuck, source)
        facts["swap_kept_error"] = None
    except ValueError as err:
        facts["swap_kept_error"] = str(err)

    # Compile VAE on a dynamic VAE patcher with VAELoader's cached_patcher_init: a regular patcher of its own model.
    facts["vae_left"] = _compile_vae_facts(pack, dynamic_vae(vae_file(Path(sys.argv[1])), with_loader=True), "vae-left")
    # ...and on one without (VAELoader's TAESD, made of two files): kept, eager, one warning.
    before = len(warnings.messages)
    facts["vae_kept"] = _compile_vae_facts(pack, dynamic_vae(None, with_loader=False), "vae-kept")
    facts["vae_kept"]["warnings"] = [m for m in warnings.messages[before:] if "dynamic VRAM" in m]

    # Core's prefetch path (comfy/model_prefetch.py): off on a CPU whatever the model says.
    facts["prefetch_queue_on_cpu"] = comfy.model_prefetch.make_prefetch_queue(
        [torch.nn.Linear(1, 1)], torch.device("cpu"), {"prefetch_dynamic_vbars": True})
    print_result(facts, default=str)


def vae_file(folder: Path) -> str:
    """A generated SD VAE file (tools/make_models.py) in `folder`, as VAELoader would read it from models/vae."""
    import safetensors.torch
    from tools.make_models import vae_state_dict

    path = folder / "accel-probe-vae.safetensors"
    safetensors.torch.save_file(vae_state_dict("sd", 0), str(path))
    return str(path)


def dynamic_vae(path: str | None, with_loader: bool):
    """A VAE whose patcher is a ModelPatcherDynamic, as a 0.33 loader on NVIDIA makes it: from `path` with
    VAELoader's cached_patcher_init, or VAELoader's TAESD (no single file: none)."""
    import comfy.model_patcher
    import comfy.sd
    import comfy.utils
    import nodes
    import torch

    if path is None:
        (vae,) = nodes.VAELoader().load_vae("taesd")
    else:
        sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
        vae = comfy.sd.VAE(sd=sd, metadata=metadata)
    vae.patcher = comfy.model_patcher.ModelPatcherDynamic(vae.first_stage_model, load_device=torch.device("cuda", 0),
                                                          offload_device=torch.device("cpu"))
    vae.patcher.cached_patcher_init = (comfy.sd.load_vae_patcher, (path, metadata, None)) if with_loader else None
    return vae


def _compile_vae_facts(pack, vae, owner: str) -> dict:
    compiled = pack.compile.compile_vae(vae, pack.compile.CompileOptions(), owner=owner)
    return {"is_dynamic": compiled.patcher.is_dynamic(),
            "model_is_patchers": compiled.first_stage_model is compiled.patcher.model,
            "same_model_as_input": compiled.first_stage_model is vae.first_stage_model,
            "input_untouched": vae.patcher.is_dynamic(), "methods_patched": sorted(compiled.patcher.object_patches),
            "status": pack.compile.status.owner_statuses()[owner]}


def _plain(patcher):
    """A clone of `patcher` without the pack's wrappers: its model's own forward."""
    import comfy.patcher_extension as pe

    plain = patcher.clone()
    plain.remove_wrappers_with_key(pe.WrappersMP.APPLY_MODEL, "accel.compile_model")
    return plain


if __name__ == "__main__":
    main()
