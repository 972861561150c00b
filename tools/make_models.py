"""Write the project's generated models into ComfyUI's model folders, from fixed seeds.

The weights are random, but architectures, file formats and key names are the real ones, and each
file is loaded back by ComfyUI's own loaders (UNETLoader, CLIPLoader, LoraLoader, VAELoader "taesd").

    python tools/make_models.py --set test   # small UNet, LoRAs, CLIP-L, TAESD, one model per family (tests, demo)
    python tools/make_models.py --set quick  # a second tiny Flux, for Swap Weights in `make bench-quick`
    python tools/make_models.py --set full   # full-size SD1.5 UNets A and B, the benchmark Flux A and B (benchmarks)
    python tools/make_models.py --set templates  # the templates' real file names, as stand-ins (tools/template_models.py)

The test set includes the templates' stand-ins. A file that already exists with the same generator version and
seed is left as it is. `--jobs N` writes N files at once (default 2): the same weights as one process writes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.comfy_env import import_comfyui  # noqa: E402
from tools.family_models import BY_NAME as FAMILY_BY_NAME  # noqa: E402
from tools.family_models import FAMILIES, FLUX_BENCH, WAN_BENCH, dit_lora_state_dict, family_state_dict  # noqa: E402

GENERATOR_VERSION = "1"

# ComfyUI's detection keys for SD1.5 (supported_models.SD15): 320 channels, 768 context, conv proj.
SD15_BASE = dict(
    use_checkpoint=False, image_size=32, in_channels=4, out_channels=4, model_channels=320,
    use_spatial_transformer=True, legacy=False, adm_in_channels=None, use_linear_in_transformer=False,
    context_dim=768, num_heads=8, use_temporal_attention=False, use_temporal_resblock=False,
)
SD15_FULL = dict(SD15_BASE, num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4],
                 transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0], transformer_depth_middle=1,
                 transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0])
# Two levels (so there is a down/upsample and a skip connection to cache across), attention at the
# first level and in the middle block, like SD1.5 at a fraction of its depth (about 34 M parameters).
SD15_SMALL = dict(SD15_BASE, num_res_blocks=[1, 1], channel_mult=[1, 1],
                  transformer_depth=[1, 0], transformer_depth_middle=1,
                  transformer_depth_output=[1, 1, 0, 0])

# The LoRA touches the first attention block, which has the same key names and shapes in the small
# and the full-size UNet, so one file applies cleanly to every generated UNet.
LORA_BLOCK = "input_blocks.1.1."
LORA_RANK = 8


def seeded_normal(shape, std: float, seed: int, key: str):
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std)  # in place: no second buffer to fault in


def fill_like_init(state_dict: dict, seed: int) -> dict:
    """Deterministic weights with the usual init scales: 1/sqrt(fan_in) for weights, norms at 1, biases at 0."""
    import torch

    out = {}
    for key, tensor in state_dict.items():
        shape = tuple(tensor.shape)
        is_norm = any(part in key for part in ("norm", "ln_", "layer_norm", "layernorm"))
        if key.endswith("weight") and is_norm:
            out[key] = torch.ones(shape)
        elif key.endswith("bias") or len(shape) == 0:
            out[key] = torch.zeros(shape)
        elif len(shape) == 1:  # embeddings-like vectors
            out[key] = seeded_normal(shape, 0.02, seed, key)
        else:
            fan_in = 1
            for dim in shape[1:]:
                fan_in *= dim
            std = 0.02 if "embedding" in key else fan_in ** -0.5
            out[key] = seeded_normal(shape, std, seed, key)
    return out


def sd15_unet_state_dict(unet_config: dict, seed: int) -> dict:
    import torch
    import comfy.supported_models

    cfg = comfy.supported_models.SD15(dict(unet_config))
    cfg.set_inference_dtype(torch.float32, None)
    model = cfg.get_model({}, device="meta")
    sd = model.diffusion_model.state_dict()
    return {"model.diffusion_model." + k: v for k, v in fill_like_init(sd, seed).items()}


def lora_state_dict(seed: int) -> dict:
    """Kohya-format LoRA (lora_unet_<diffusers name>.lora_down/lora_up/alpha), as LoraLoader reads it."""
    import torch
    import comfy.utils

    diffusers_to_unet = comfy.utils.unet_to_diffusers(dict(SD15_SMALL, num_heads=8, num_head_channels=-1))
    unet_sd = sd15_unet_state_dict(SD15_SMALL, seed=0)
    out = {}
    for diffusers_key, unet_key in sorted(diffusers_to_unet.items()):
        full_key = "model.diffusion_model." + unet_key
        if not unet_key.startswith(LORA_BLOCK) or not diffusers_key.endswith(".weight"):
            continue
        weight = unet_sd.get(full_key)
        if weight is None or weight.dim() != 2:  # linear layers only (attention and feed-forward)
            continue
        name = "lora_unet_" + diffusers_key[: -len(".weight")].replace(".", "_")
        out_features, in_features = weight.shape
        out[name + ".lora_down.weight"] = seeded_normal((LORA_RANK, in_features), in_features ** -0.5, seed, name + "d")
        out[name + ".lora_up.weight"] = seeded_normal((out_features, LORA_RANK), 0.2 / LORA_RANK ** 0.5, seed, name + "u")
        out[name + ".alpha"] = torch.tensor(float(LORA_RANK))
    if not out:
        raise RuntimeError("the LoRA generator matched no UNet keys; ComfyUI's key mapping changed")
    return out


def clip_l_state_dict(seed: int) -> dict:
    import torch
    import comfy.sd1_clip

    clip = comfy.sd1_clip.SDClipModel(device="meta", dtype=torch.float32)
    sd = {k: v for k, v in clip.transformer.state_dict().items() if "position_ids" not in k}
    return fill_like_init(sd, seed)


# ComfyUI's VAE for SD1.x/SDXL checkpoints (comfy/sd.py reads only z_channels from the weights: the widths are
# fixed) and, with 16 latent channels and no quant convs, Flux's ae.safetensors.
SD_VAE_CONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                 "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
# Wan 2.1's VAE (also Qwen-Image's): ComfyUI reads its width from the weights, so the stand-in is narrow.
WAN_VAE_TINY = dict(dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                    temperal_downsample=[False, True, True], dropout=0.0)


def vae_state_dict(kind: str, seed: int) -> dict:
    """A VAE as ComfyUI's VAELoader and checkpoint loader read it: "sd" (with quant convs, as in a checkpoint),
    "flux" (16 channels, no quant convs) or "wan21"."""
    import torch
    from tools.family_models import fill_family

    with torch.device("meta"):
        if kind == "wan21":
            from comfy.ldm.wan.vae import WanVAE

            module = WanVAE(**WAN_VAE_TINY)
        else:
            from comfy.ldm.models.autoencoder import AutoencoderKL

            z = 4 if kind == "sd" else 16
            module = AutoencoderKL(ddconfig=dict(SD_VAE_CONFIG, z_channels=z), embed_dim=z)
    state_dict = fill_family(module, seed)
    if kind == "flux":  # Flux's autoencoder has no quant convs
        state_dict = {k: v for k, v in state_dict.items() if k.startswith(("encoder.", "decoder."))}
    return state_dict


def checkpoint_state_dict(family: str, seed: int) -> dict:
    """A checkpoint as CheckpointLoaderSimple reads it: the small UNet of `family` ("sd15" or "sdxl") with its real
    text encoders (CLIP-L; SDXL adds CLIP-G) and VAE, each in ComfyUI's own checkpoint key format."""
    import torch
    import comfy.sdxl_clip
    import comfy.supported_models
    from tools.family_models import BY_NAME as FAMILIES_BY_NAME, family_state_dict

    if family == "sd15":
        unet = sd15_unet_state_dict(SD15_SMALL, seed)
        clip = {"cond_stage_model.transformer." + k: v for k, v in clip_l_state_dict(seed).items()}
    else:
        unet = family_state_dict(FAMILIES_BY_NAME["sdxl"], seed)
        with torch.device("meta"):
            encoders = comfy.sdxl_clip.SDXLClipModel(device="meta", dtype=torch.float32)
        filled = fill_like_init({k: v for k, v in encoders.state_dict().items() if "position_ids" not in k}, seed)
        config = comfy.supported_models.SDXL(dict(FAMILIES_BY_NAME["sdxl"].unet_config))
        clip = config.process_clip_state_dict_for_saving(filled)
    vae = {"first_stage_model." + k: v for k, v in vae_state_dict("sd", seed).items()}
    # position ids are integers ComfyUI makes itself: left out (every tensor is written as fp16)
    return {k: v for k, v in {**unet, **clip, **vae}.items() if "position_ids" not in k}


def taesd_state_dicts(seed: int) -> tuple[dict, dict]:
    import torch
    from comfy.taesd.taesd import Decoder, Encoder

    with torch.device("meta"):
        enc, dec = Encoder(4), Decoder(4)
    return fill_like_init(enc.state_dict(), seed), fill_like_init(dec.state_dict(), seed + 1)


@dataclass(frozen=True)
class ModelFile:
    folder: str  # folder under ComfyUI's models/ (each is one of ComfyUI's registered model paths)
    name: str
    seed: int
    build: Callable[[int], dict]
    sets: tuple[str, ...]


def taesd_part(index: int) -> Callable[[int], dict]:
    return lambda seed: taesd_state_dicts(seed)[index]


FLUX_BENCH_B = "accel-tiny-flux-bench-b.safetensors"
FLUX_QUICK_B = "accel-tiny-flux-b.safetensors"

# Sets that `--set all` (`make models`, the CPU benchmarks' models) leaves out: written only when named.
ON_REQUEST_ONLY = {"video"}  # a GPU benchmark's 2.8 GB Wan

MODEL_FILES = [
    ModelFile("diffusion_models", "accel-sd15-small.safetensors", 1, lambda s: sd15_unet_state_dict(SD15_SMALL, s), ("test",)),
    ModelFile("diffusion_models", "accel-sd15-small-b.safetensors", 2, lambda s: sd15_unet_state_dict(SD15_SMALL, s), ("test",)),
    ModelFile("loras", "accel-sd15-lora.safetensors", 11, lora_state_dict, ("test",)),
    ModelFile("loras", "accel-sd15-lora-2.safetensors", 12, lora_state_dict, ("test",)),
    ModelFile("clip", "accel-clip-l.safetensors", 21, clip_l_state_dict, ("test",)),
    ModelFile("vae_approx", "taesd_encoder.safetensors", 31, taesd_part(0), ("test",)),
    ModelFile("vae_approx", "taesd_decoder.safetensors", 31, taesd_part(1), ("test",)),
    # One model per ComfyUI transformer family, plus SDXL (tools/family_models.py); "wide" ones are 0.4-2 GB.
    *[ModelFile("diffusion_models", f.file_name, 41 + i, lambda s, f=f: family_state_dict(f, s), ("test",))
      for i, f in enumerate(FAMILIES)],
    ModelFile("loras", "accel-flux-lora.safetensors", 61, lambda s: dit_lora_state_dict("flux", s), ("test",)),
    ModelFile("loras", "accel-flux-lora-2.safetensors", 62, lambda s: dit_lora_state_dict("flux", s), ("test",)),
    ModelFile("diffusion_models", "accel-sd15-a.safetensors", 101, lambda s: sd15_unet_state_dict(SD15_FULL, s), ("full",)),
    ModelFile("diffusion_models", "accel-sd15-b.safetensors", 102, lambda s: sd15_unet_state_dict(SD15_FULL, s), ("full",)),
    ModelFile("diffusion_models", FLUX_BENCH.file_name, 103, lambda s: family_state_dict(FLUX_BENCH, s), ("full",)),
    # Second files of the benchmark Flux models, for Swap Weights in the report (`make bench`, `make bench-quick`).
    ModelFile("diffusion_models", FLUX_BENCH_B, 104, lambda s: family_state_dict(FLUX_BENCH, s), ("full",)),
    ModelFile("diffusion_models", FLUX_QUICK_B, 141, lambda s: family_state_dict(FAMILY_BY_NAME["flux"], s),
              ("quick",)),
    # DeepCache's video speed at real scale (bench/deepcache_speed.py --family wan writes it when missing).
    ModelFile("diffusion_models", WAN_BENCH.file_name, 151, lambda s: family_state_dict(WAN_BENCH, s), ("video",)),
]


def _metadata(path: Path) -> dict | None:
    """A safetensors file's metadata; None when it cannot be read as one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception:
        return None


def is_current(path: Path, spec: ModelFile) -> bool:
    meta = _metadata(path) if path.exists() else None
    return bool(meta) and meta.get("accel_generator") == GENERATOR_VERSION and meta.get("accel_seed") == str(spec.seed)


def needs_writing(path: Path, spec: ModelFile) -> bool:
    """Whether to (re)write `path`: missing, or written by this script for another seed or version. A file of that
    name this script did not write stays: with COMFYUI_DIR at a user's own ComfyUI, vae_approx/ holds their real
    TAESD under the names the tests' generated one takes (before, set-up replaced it with random weights). Files
    are written under another name and renamed (write_model), so a file of ours is never half-written."""
    if not path.exists():
        return True
    meta = _metadata(path)
    if not meta or "accel_generator" not in meta:
        print(f"[models] kept {path}: this script did not write it (your own file?), so the tests use it as it is",
              flush=True)
        return False
    return not is_current(path, spec)


def write_model(path: Path, spec: ModelFile) -> None:
    import torch
    from safetensors.torch import save_file

    start = time.perf_counter()
    tensors = {k: v.to(torch.float16).contiguous() for k, v in spec.build(spec.seed).items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"accel_generator": GENERATOR_VERSION, "accel_seed": str(spec.seed)})
    tmp.replace(path)  # never leave a half-written model under the real name
    params = sum(t.numel() for t in tensors.values())
    print(f"[models] wrote {path} ({params / 1e6:.1f} M params, {time.perf_counter() - start:.1f} s)", flush=True)


PLACEHOLDER_NOTE = ("a stand-in for the name only: the project's tests replace the nodes that would load it with "
                    "conditioning tensors (tools/template_models.py)")


# The block a template LoRA stand-in touches, per family: its first transformer block's linear layers.
TEMPLATE_LORA_BLOCKS = {"qwen_image": ("transformer_blocks.0.",)}
# How a generated stand-in is built, by its kind in tools/template_models.py ("<kind>:<what>:<seed>").
STANDIN_BUILDERS = {
    "checkpoint": checkpoint_state_dict,
    "vae": vae_state_dict,
    "lora": lambda family, seed: dit_lora_state_dict(family, seed, TEMPLATE_LORA_BLOCKS[family]),
}


def standin_spec(model) -> ModelFile:
    """A generated stand-in of a template's real file, as a model file of its own seed."""
    kind, what, seed = model.standin.split(":")
    return ModelFile(model.directory, model.name, int(seed), lambda s: STANDIN_BUILDERS[kind](what, s), ())


def standins(standins_folder: Path, only: str | None) -> tuple[list, list]:
    """The templates' real file names under `standins_folder` (tools/template_models.py): (the generated stand-ins
    not yet current, as (path, ModelFile); the links to generated test models and the placeholders for the text
    encoders the tests never load, as (path, how), for `link_and_place`)."""
    from tools.template_models import REAL_MODELS

    generated, others = [], []
    for model in REAL_MODELS:
        if only and only not in model.name:
            continue
        path = standins_folder / model.directory / model.name
        path.parent.mkdir(parents=True, exist_ok=True)
        if model.standin.partition(":")[0] in ("link", "placeholder"):
            others.append((path, model.standin))
        else:
            spec = standin_spec(model)
            if not is_current(path, spec):
                generated.append((path, spec))
    return generated, others


def link_and_place(models_dir: Path, others: list) -> None:
    """The stand-ins' links (after the test set's files they point at are written) and placeholders."""
    import torch
    from safetensors.torch import save_file

    for path, standin in others:
        kind, _, rest = standin.partition(":")
        if kind == "link":
            target = models_dir / rest
            if not target.exists():
                raise FileNotFoundError(f"{path.name}'s stand-in links to {target}, which the test set writes first")
            if not (path.is_symlink() and path.resolve() == target.resolve()):
                path.unlink(missing_ok=True)
                path.symlink_to(target)
                print(f"[models] linked {path} -> {target}", flush=True)
        elif not path.exists():
            save_file({"placeholder": torch.zeros(1)}, str(path), metadata={"accel_placeholder": PLACEHOLDER_NOTE})
            print(f"[models] wrote the placeholder {path}", flush=True)


def write_all(pending: list[tuple[Path, ModelFile]], jobs: int) -> None:
    """Write each file by one process of `jobs`: the same weights as one process writes (each file's come from its
    own seeds; only the order of safetensors' metadata varies, as it does between two runs of one process). The
    test set took 89 s in one process and 66 s in two on the 2-core machine (2026-11-27; the rest is writing 8 GB).
    The processes are forked after the imports, before any tensor work, and draw on one thread each."""
    import multiprocessing

    if jobs <= 1 or len(pending) <= 1 or "fork" not in multiprocessing.get_all_start_methods():  # Windows: one
        for path, spec in pending:
            write_model(path, spec)
        return
    from concurrent.futures import ProcessPoolExecutor

    global _PENDING
    _PENDING = pending  # what the forked processes find by index (a spec's build is a lambda: not picklable)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for _ in pool.map(_write_pending, range(len(pending))):
            pass  # map raises the first file's error here


_PENDING: list[tuple[Path, ModelFile]] = []


def _write_pending(index: int) -> None:
    import torch

    torch.set_num_threads(1)  # one file per core
    write_model(*_PENDING[index])


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the generated test and benchmark models.")
    parser.add_argument("--set", default="test", choices=["test", "quick", "full", "templates", "video", "all"])
    parser.add_argument("--only", help="write only the files whose names contain this text")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes writing files at once (default: 2, or 1 on a one-core machine)")
    args = parser.parse_args()
    comfy_dir = import_comfyui()
    import folder_paths
    from tools.template_models import standins_dir

    pending = []
    for spec in MODEL_FILES:
        if args.set == "all" and set(spec.sets) <= ON_REQUEST_ONLY:
            continue
        if args.set != "all" and args.set not in spec.sets or args.only and args.only not in spec.name:
            continue
        folder = Path(folder_paths.models_dir) / spec.folder
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / spec.name
        if needs_writing(path, spec):
            pending.append((path, spec))
    others = []
    if args.set in ("test", "templates", "all"):
        generated, others = standins(standins_dir(comfy_dir), args.only)
        pending = generated + pending  # the largest first (two SDXL checkpoints): the processes end closer together
    write_all(pending, args.jobs)
    link_and_place(Path(folder_paths.models_dir), others)  # after: the links point at the files just written


if __name__ == "__main__":
    main()
