"""Where new weights come from, one tensor at a time: a safetensors file, or another MODEL's base weights.

A source speaks in the model's own state-dict keys ("diffusion_model.input_blocks.0.0.weight"), whatever prefix
the file uses. Files are read with plain positional reads into a buffer of one tensor, not through a memory map
held open for the whole file: a map keeps every page it touched resident, which would count a second model's
worth of memory while streaming a full checkpoint.
"""
from __future__ import annotations

import json
import os
import struct
import weakref
from dataclasses import dataclass

import torch

MODEL_PREFIX = "diffusion_model."  # where BaseModel keeps the diffusion model
MAX_HEADER_BYTES = 100 * 1024 * 1024

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    file_key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def file_identity(path: str) -> tuple:
    """What makes two reads of a path the same weights: the resolved path, its size and modification time."""
    stat = os.stat(path)
    return (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


def read_header(f, path: str) -> tuple[dict, int]:
    """The safetensors JSON header and where the data starts, read from `f`, an open handle of the file at `path`
    (named in errors). Reads only the header."""
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"Swap Weights: {path} is not a safetensors file (it is {len(head)} bytes long).")
    size = struct.unpack("<Q", head)[0]
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"Swap Weights: {path} is not a safetensors file (header size {size}). "
                         "Swap Weights reads .safetensors checkpoints and diffusion-model files.")
    header = json.loads(f.read(size))
    return header, 8 + size


# The keys beside a checkpoint's weights from which ComfyUI's checkpoint loader takes how the model samples
# (supported_models' model_type): v-prediction and zero terminal SNR (NoobAI-XL v-pred and the like), EDM
# v-prediction's sigmas, Playground 2.5's EDM.
MODEL_TYPE_MARKERS = ("v_pred", "ztsnr", "edm_vpred.sigma_max", "edm_vpred.sigma_min", "edm_mean", "edm_std")


def model_keys_for(file_keys: list[str]) -> dict[str, str]:
    """file key -> model key, stripping the checkpoint prefix the way ComfyUI's loaders do (a checkpoint's
    "model.diffusion_model.", or none for a diffusion-model file)."""
    from comfy.model_detection import unet_prefix_from_state_dict

    prefix = unet_prefix_from_state_dict(dict.fromkeys(file_keys))
    stripped = {k: k[len(prefix):] for k in file_keys if k.startswith(prefix)}
    if not stripped:  # a file of the diffusion model alone: keys have no prefix
        stripped = {k: k for k in file_keys}
    return {file_key: MODEL_PREFIX + key for file_key, key in stripped.items()}


class WeightsFile:
    """A safetensors checkpoint or diffusion-model file, indexed from its header alone."""

    kind = "file"

    def __init__(self, path: str, label: str | None = None):
        self.path = path
        self.label = label or os.path.basename(path)
        # Held open for the maps of `mapped`: they come from the file this header was read from, even once its
        # name is gone (ComfyUI empties its temp folder, where spill files are, when another ComfyUI on it starts)
        # or names another file (a checkpoint downloaded again).
        self.handle = open(path, "rb")
        weakref.finalize(self, self.handle.close)
        self.id = ("file",) + file_identity(path)
        header, data_start = read_header(self.handle, path)
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        # a checkpoint's keys beside its weights that tell ComfyUI's loader how to sample it (validate.py)
        self.model_type_markers = sorted(set(entries) & set(MODEL_TYPE_MARKERS))
        self.infos: dict[str, TensorInfo] = {}
        for file_key, model_key in model_keys_for(list(entries)).items():
            entry = entries[file_key]
            if entry["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"Swap Weights: {self.label}: tensor {file_key} has dtype {entry['dtype']}, "
                                 f"which Swap Weights cannot read.")
            begin, end = entry["data_offsets"]
            self.infos[model_key] = TensorInfo(file_key, SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]),
                                               data_start + begin, data_start + end)
        self.data_end = max((i.end for i in self.infos.values()), default=data_start)

    def keys(self) -> list[str]:
        """Model keys in file order, so a full read is one sequential pass over the file."""
        return sorted(self.infos, key=lambda k: self.infos[k].start)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.infos[key].shape

    def check_readable(self) -> None:
        size = os.path.getsize(self.path)
        if size < self.data_end:
            raise ValueError(f"Swap Weights: {self.label} is truncated ({size} bytes; its header describes "
                             f"{self.data_end}). Copy or download the file again.")

    def open(self) -> "FileReader":
        if file_identity(self.path) != self.id[1:]:
            raise RuntimeError(f"Swap Weights: {self.label} changed on disk after the node read it; run the "
                               "workflow again: the node reads the new file then (its IS_CHANGED sees the change).")
        return FileReader(self)

    def mapped(self, key: str) -> torch.Tensor:
        """The tensor as a copy-on-write map of the file: no memory is used until something reads it. ComfyUI's
        unpatch reads it once and drops it, so its pages are released again."""
        import numpy as np

        info = self.infos[key]
        if info.end == info.start:
            return torch.empty(info.shape, dtype=info.dtype)
        raw = np.memmap(self.handle, dtype=np.uint8, mode="c", offset=info.start, shape=(info.end - info.start,))
        return torch.from_numpy(raw).view(info.dtype).reshape(info.shape)


class FileReader:
    """Reads one tensor at a time into one staging buffer, reused for every tensor of the swap.

    One buffer the size of the largest tensor, allocated once, instead of one per tensor: hundreds of freed
    buffers of many sizes fragment the C heap, which keeps their memory (hundreds of MB at full size) after the
    swap. A tensor returned by `read` is valid until the next `read`; the swap copies it into its parameter first.
    """

    def __init__(self, source: WeightsFile):
        self.source = source
        self.file = open(source.path, "rb", buffering=0)
        largest = max((info.end - info.start for info in source.infos.values()), default=0)
        self.staging = torch.empty(largest, dtype=torch.uint8)

    def read(self, key: str) -> torch.Tensor:
        info = self.source.infos[key]
        buffer = self.staging[:info.end - info.start]
        view, got = memoryview(buffer.numpy()), 0
        self.file.seek(info.start)
        while got < len(view):  # a single read returns at most ~2 GB on Linux
            count = self.file.readinto(view[got:])
            if not count:
                raise OSError(f"Swap Weights: {self.source.label} ended after {info.start + got} bytes, in the "
                              f"middle of tensor {info.file_key}: the file is truncated or being replaced.")
            got += count
        return buffer.view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        self.file.close()
        self.staging = torch.empty(0, dtype=torch.uint8)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
