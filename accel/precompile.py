"""Precompile: warm the persistent compile cache for chosen sizes off the critical path.

Runs in a process of its own (`python -m accel precompile ...`), with ComfyUI imported in-process, the model
loaded by ComfyUI's own loader and sampled one step per size through ComfyUI's sampler, so the compiled graphs
are exactly the ones a workflow's first sampling will ask for:

- per size and batch, the graphs a fresh process compiles when that size comes first (Dynamo state is reset
  between sizes; this process is ours, so resetting it touches nobody else);
- then the shape-generic graphs a process compiles once it has seen a second size;
- last, each kind's graphs saved whole (precompiled functions, compile/precompiled.py), made as a background
  child makes them (compile/child/compile_kind.compile_item) from the calls recorded above, their graphs from the
  torch caches those calls filled. A server's first prompt at these sizes then loads each kind in milliseconds
  (on the CPU once inductor's per-process checks ran) and starts no child: no Dynamo tracing in it at all.
"""
from __future__ import annotations

import itertools
import logging
import os
import shlex
import time
from pathlib import Path

log = logging.getLogger("comfyui_accel")


class PrecompileError(ValueError):
    """Bad input to precompile: the message names the problem and the fix."""


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """"512x512,768x1024" -> [(512, 512), (768, 1024)] as (width, height) in pixels, multiples of 8."""
    sizes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            width, height = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise PrecompileError(f"--sizes: {part!r} is not WIDTHxHEIGHT; write e.g. --sizes 512x512,768x1024")
        if width <= 0 or height <= 0 or width % 8 or height % 8:
            raise PrecompileError(f"--sizes: {part} must be positive multiples of 8 (latents are 1/8 of the image)")
        sizes.append((width, height))
    if not sizes:
        raise PrecompileError("--sizes is empty; write e.g. --sizes 512x512")
    return sizes


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise PrecompileError(f"--batch: {text!r} is not a list of whole numbers; write e.g. --batch 1,2")
    if not batches or min(batches) < 1:
        raise PrecompileError("--batch needs one or more batch sizes of at least 1, e.g. --batch 1,2")
    return batches


DEVICE_FLAGS = ("cuda_device", "default_device")


def import_comfyui(comfy_dir: Path, cpu: bool, comfyui_args: str = "") -> None:
    """ComfyUI's core in this process, as its main.py would set it up (model folders included), with the server's
    flags `comfyui_args` (as on main.py's command line): graphs saved whole serve a server only where the flags
    that change what its blocks compute are the same (compile/precompiled.py, the context of a saved graph)."""
    from .comfy_import import import_comfyui_core, is_base_directory, parse_comfyui_flags

    if not (comfy_dir / "main.py").is_file():
        base = (f"; {comfy_dir} looks like a ComfyUI --base-directory: pass --comfyui with ComfyUI's own folder and "
                f"--comfyui-args=\"--base-directory {shlex.quote(str(comfy_dir))}\"" if is_base_directory(comfy_dir)
                else "")
        raise PrecompileError(f"no ComfyUI at {comfy_dir} (no main.py); pass --comfyui DIR or set COMFYUI_DIR{base}")

    try:
        flags = parse_comfyui_flags(comfy_dir, comfyui_args)
    except ValueError as err:
        raise PrecompileError(f"--comfyui-args: {err}") from err
    cpu = flags.pop("cpu", False) or cpu
    for flag in DEVICE_FLAGS:  # main.py turns them into CUDA_VISIBLE_DEVICES before torch starts: too late here
        if flags.get(flag) is not None:
            raise PrecompileError(f"--comfyui-args: --{flag.replace('_', '-')} picks the GPU in ComfyUI's main.py, "
                                  f"which precompile does not run; set CUDA_VISIBLE_DEVICES for precompile instead")
    import_comfyui_core(comfy_dir, cpu, **flags)
    import utils.extra_config

    # the model folders as main.py adds them: ComfyUI's own file, the server's --extra-model-paths-config files
    extra = comfy_dir / "extra_model_paths.yaml"
    configs = [str(extra)] if extra.is_file() else []
    configs += list(itertools.chain(*(flags.get("extra_model_paths_config") or [])))
    configs += list(filter(None, os.environ.get("ACCEL_EXTRA_MODEL_PATHS", "").split(os.pathsep)))
    for path in configs:
        utils.extra_config.load_extra_path_config(path)


def load_model(name: str):
    """A ModelPatcher for `name`: a file path, or a file in ComfyUI's diffusion_models or checkpoints folder."""
    import comfy.sd
    import folder_paths

    path = Path(name).expanduser()
    folder = None
    if not path.is_file():
        for folder in ("diffusion_models", "checkpoints"):
            found = folder_paths.get_full_path(folder, name)
            if found:
                path = Path(found)
                break
        else:
            raise PrecompileError(f"--model {name}: no such file, and not in ComfyUI's diffusion_models or "
                                  f"checkpoints folders; pass a path or a name listed there")
    errors = []
    loaders = [lambda: comfy.sd.load_diffusion_model(str(path)),
               lambda: comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False)[0]]
    for load in loaders[folder == "checkpoints":]:
        try:
            model = load()
        except RuntimeError as err:  # ComfyUI's "Could not detect model type" and the like
            errors.append(str(err).strip())
            continue
        if model is not None:
            return model
    raise PrecompileError(f"--model {name}: ComfyUI finds no diffusion model in {path} ({'; '.join(errors) or 'none'})"
                          f"; pass a checkpoint or diffusion-model file, not a LoRA, VAE or text encoder")


def _conds(patcher):
    import torch

    unet_config = patcher.model.model_config.unet_config
    context_dim = unet_config.get("context_dim")
    if not context_dim:
        raise PrecompileError(f"precompile covers cross-attention UNets (SD1.x, SD2.x, SDXL); "
                              f"{type(patcher.model).__name__} has none. Compile it by running a workflow instead.")
    extra = {"pooled_output": torch.zeros(1, 1280)} if unet_config.get("adm_in_channels") else {}
    context = torch.zeros(1, 77, context_dim)
    return [[context, dict(extra)]], [[torch.zeros_like(context), dict(extra)]]


def precompile(model_name: str, sizes: list[tuple[int, int]], batches: list[int], options, cfg: float = 7.0) -> dict:
    """Compile `model_name` for every size and batch into the persistent cache. Returns a summary."""
    import torch

    # ComfyUI's executor runs every node in inference mode, so a workflow's weights, conditioning and latents are
    # inference tensors; a graph's guards tell those from normal ones, so precompile makes them the same way
    with torch.inference_mode():
        return _precompile(model_name, sizes, batches, options, cfg)


def _precompile(model_name: str, sizes: list[tuple[int, int]], batches: list[int], options, cfg: float) -> dict:
    import comfy.model_management
    import comfy.sample
    import torch

    from .cache import COMPILE_CACHE
    from .compile import compile_model
    from .compile.policy import device_policy
    from .compile.registry import REGISTRY

    device = comfy.model_management.get_torch_device()
    policy = device_policy(device)
    if not policy.allows("compile"):  # the nodes would run eagerly: nothing to put in the cache
        raise PrecompileError(f"nothing to precompile: on {device} {policy.explain('compile')}")
    cache = COMPILE_CACHE.environment(device.type)
    if not cache.check_usable():  # compiling would warm nothing that outlives this process: an image build's error
        raise PrecompileError(f"the compile cache at {cache.dir} cannot be used ({cache.problem}), so nothing "
                              "would be kept: set ACCEL_CACHE_DIR to a folder of your own that you can write to")
    patcher = load_model(model_name)
    compiled = compile_model(patcher, options)
    # the background compile, whose code saves kinds whole, compiles repeated blocks only: a whole model's graphs
    # stay in torch's caches
    recorded = {} if options.whole_model else REGISTRY.record_compiled_calls()
    positive, negative = _conds(patcher)
    channels = patcher.model.latent_format.latent_channels

    def sample_once(width: int, height: int, batch: int) -> None:
        latent = torch.zeros(batch, channels, height // 8, width // 8)
        noise = comfy.sample.prepare_noise(latent, 0)
        comfy.sample.sample(compiled, noise, 1, cfg, "euler", "normal", positive, negative, latent,
                            disable_pbar=True, seed=0)

    combos = [(w, h, b) for (w, h) in sizes for b in batches]
    start = time.perf_counter()
    for width, height, batch in combos:  # what a fresh process compiles when this size comes first
        torch._dynamo.reset()
        REGISTRY.forget_shapes()
        log.info("[Accel] precompile: %dx%d batch %d", width, height, batch)
        sample_once(width, height, batch)
    if len(combos) > 1:  # what it compiles once it has seen another size: the shape-generic graphs
        for width, height, batch in combos:
            sample_once(width, height, batch)
    stats = REGISTRY.stats()
    compiled_seconds = time.perf_counter() - start
    saved = {"whole model": "not saved whole (the background compile saves repeated blocks only); torch's caches "
                            "hold its graphs"} if options.whole_model else save_whole(recorded.values())
    if not cache.usable:  # the disk filled up meanwhile: what compiled is in torch's temporary cache only
        raise PrecompileError(f"the compile cache at {cache.dir} stopped keeping what compiled ({cache.problem}): "
                              "free some space there, or set ACCEL_CACHE_DIR to a disk with room, and run again")
    return {"model": model_name, "sizes": [f"{w}x{h}" for w, h in sizes], "batches": batches,
            "seconds": round(compiled_seconds, 1), "kinds": len(stats["kinds"]),
            "compiles": stats["totals"]["compiles"], "disk_cache": stats["totals"]["disk_cache"],
            "precompiled": saved, "precompiled_seconds": round(time.perf_counter() - start - compiled_seconds, 1),
            "cache": COMPILE_CACHE.stats()}


def save_whole(captures) -> dict:
    """Each recorded kind (background.Capture) compiled again as a background child compiles it, from a registry
    of its own and Dynamo's caches reset (so its graphs are those a new process makes, out of torch's caches now
    warm), and saved whole. {kind: the number of graphs saved, or why none}."""
    import torch

    from .compile.child.compile_kind import compile_item
    from .compile.background.skeleton import CaptureError
    from .compile.precompiled import unavailable
    from .compile.registry import GraphRegistry

    why = unavailable()
    if why:
        return {capture.entry.kind.label: why for capture in captures}
    torch._dynamo.reset()
    registry, saved = GraphRegistry(), {}
    for capture in captures:
        try:
            item = capture.job_item()
        except CaptureError as err:
            saved[capture.entry.kind.label] = f"not captured ({err})"
            continue
        try:
            result = compile_item(item, registry)
        except Exception as err:  # noqa: BLE001  (this kind's graphs stay in torch's caches; the next kind may save)
            saved[capture.entry.kind.label] = f"failed: {type(err).__name__}: {str(err)[:200]}"
            continue
        saved[result["kind"]] = f"failed: {result['failure']}" if result["failure"] else result["precompiled"]
    return saved
