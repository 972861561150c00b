"""Quantized copies of the generated models, as people store and download weights: an fp8 "scaled" checkpoint
(ComfyUI's `scaled_fp8` format) and GGUF files (city96's ComfyUI-GGUF format, Q8_0 and Q4_0).

Written from a generated model's safetensors file (tools/make_models.py, tools/family_models.py) into a folder the
caller names, which tests add to ComfyUI's model paths: nothing is written into a ComfyUI tree.

The scaled fp8 format, as both tested ComfyUIs detect it: the diffusion model's keys with a `scaled_fp8` marker
tensor whose dtype is the fp8 type (model_base.state_dict_for_saving writes `torch.tensor([], dtype=...)`), every
Linear weight in that fp8 type and beside it a float32 scalar `<layer>.scale_weight` (the weight is fp8 * scale).
0.3.75 reads the marker in model_detection.model_config_from_unet (`scaled_fp8_ops`); 0.33 converts it to its
per-layer quantization metadata first (comfy.utils.convert_old_quants, `TensorCoreFP8Layout`).

GGUF: the diffusion model's keys without ComfyUI's prefix, `general.architecture` naming the family as
ComfyUI-GGUF's loader expects it (loader.IMG_ARCH_LIST). Each 2-D weight whose rows split into whole quant blocks
is quantized; every other tensor (biases, norms, convolutions) stays F32, as ComfyUI-GGUF's own converter keeps
one-dimensional and small tensors.
"""
from __future__ import annotations

from pathlib import Path

PREFIX = "model.diffusion_model."
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
GGUF_ARCH = {"SD15": "sd1", "Flux": "flux"}  # model_base class name -> ComfyUI-GGUF's architecture name
# Tensors smaller than this stay F32 (ComfyUI-GGUF's converter has a threshold of its own for the same reason:
# quantizing them saves nothing and costs precision).
GGUF_MIN_QUANTIZED = 1024


def generated_state_dict(comfy_dir: Path, name: str) -> dict:
    """A generated UNet file's weights (with ComfyUI's `model.diffusion_model.` prefix)."""
    import safetensors.torch

    return safetensors.torch.load_file(str(comfy_dir / "models" / "diffusion_models" / name))


def diffusion_keys(state_dict: dict) -> dict:
    """The diffusion model's keys without ComfyUI's prefix (files of either form are accepted)."""
    if not any(k.startswith(PREFIX) for k in state_dict):
        return dict(state_dict)
    return {k[len(PREFIX):]: v for k, v in state_dict.items() if k.startswith(PREFIX)}


def scaled_fp8_state_dict(state_dict: dict, fp8_dtype: str = "float8_e4m3fn") -> dict:
    """The model's weights in the scaled fp8 format (module docstring): every 2-D weight (ComfyUI makes every
    Linear of the model a scaled-fp8 Linear) divided by a per-tensor scale that maps its largest value to the
    fp8 type's largest, stored in fp8; the rest as they were."""
    import torch

    dtype = getattr(torch, fp8_dtype)
    out = {}
    for key, tensor in diffusion_keys(state_dict).items():
        if key.endswith(".weight") and tensor.dim() == 2:
            weight = tensor.float()
            scale = (weight.abs().max() / FP8_MAX[fp8_dtype]).clamp(min=1e-12)
            out[key] = (weight / scale).to(dtype)
            out[key[: -len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[key] = tensor
    out["scaled_fp8"] = torch.tensor([], dtype=dtype)
    return {PREFIX + k: v for k, v in out.items()}


def write_scaled_fp8(state_dict: dict, path: Path, fp8_dtype: str = "float8_e4m3fn") -> Path:
    import safetensors.torch

    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(scaled_fp8_state_dict(state_dict, fp8_dtype), str(path))
    return path


def write_gguf(state_dict: dict, path: Path, arch: str, quant: str = "Q8_0") -> dict[str, int]:
    """A GGUF file of the model's weights (module docstring) with the `gguf` package; returns how many tensors
    each quant type holds."""
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, quant)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    counts: dict[str, int] = {}
    for key, tensor in sorted(diffusion_keys(state_dict).items()):
        data = tensor.float().numpy().astype(np.float32)
        if data.ndim == 2 and data.size >= GGUF_MIN_QUANTIZED and data.shape[-1] % block == 0:
            kind = qtype
            data = gguf.quants.quantize(data, qtype)
        else:
            kind = gguf.GGMLQuantizationType.F32
        writer.add_tensor(key, data, raw_dtype=kind)
        counts[kind.name] = counts.get(kind.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


# city96's ComfyUI-GGUF beside the project (read-only there); ACCEL_COMFYUI_GGUF names another checkout.
GGUF_NODES = Path(__file__).resolve().parent.parent.parent / "shared" / "custom_nodes" / "ComfyUI-GGUF"


def gguf_nodes_folder() -> Path:
    import os

    folder = Path(os.environ.get("ACCEL_COMFYUI_GGUF") or GGUF_NODES)
    if not (folder / "nodes.py").exists():
        raise FileNotFoundError(f"No ComfyUI-GGUF at {folder}: set ACCEL_COMFYUI_GGUF to a checkout of "
                                "https://github.com/city96/ComfyUI-GGUF")
    return folder


def load_gguf_nodes(custom_nodes: Path) -> Path:
    """ComfyUI-GGUF linked into `custom_nodes` (as ComfyServer's extra_nodes links a folder into a server's) and
    loaded in this process by ComfyUI's own custom-node loader. Its `gguf` requirement comes from the registry
    (tools/setup_env.py TEST_TOOLS)."""
    import asyncio

    import nodes

    try:
        import gguf  # noqa: F401
    except ImportError as missing:
        raise ImportError("ComfyUI-GGUF needs the `gguf` package: run `make setup` (it installs the test tools)") \
            from missing
    folder = gguf_nodes_folder()
    link = custom_nodes / folder.name
    if not link.exists():
        link.symlink_to(folder, target_is_directory=True)
    if not asyncio.run(nodes.load_custom_node(str(link))):
        raise RuntimeError(f"ComfyUI failed to load ComfyUI-GGUF from {link} (see the log above)")
    return link
