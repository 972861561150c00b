"""Where a swapped model's original weights come back from, without a second copy of them in memory.

ComfyUI restores base weights from its patchers' shared `backup` dict whenever another clone of the model loads
(and when the model unloads). For each weight a swap replaces, the swap puts an entry there whose tensor is a
copy-on-write map of a file holding the original: it costs no memory until ComfyUI reads it back. The file is
- the file the model was loaded from, when it is known and its contents are verified against the model: newer
  ComfyUI records it on the loader's patcher (`cached_patcher_init`), and the node traces the workflow's loader; or
- a spill file, written tensor by tensor just before the swap overwrites each original (ComfyUI's temp folder,
  deleted with the model). It is written once per model: later swaps of the same model reuse it.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref

import torch

from .sources import DTYPE_NAMES, MODEL_PREFIX, WeightsFile

log = logging.getLogger("comfyui_accel")
VERIFY_SAMPLES = 16  # tensors compared bit for bit before a file is trusted as the model's original
_spill_count = 0
_spill_lock = threading.Lock()


class KnownOrigin:
    kind = "file"

    def __init__(self, weights: WeightsFile):
        self.weights = weights
        self.id = weights.id
        self.label = weights.label

    def needs_write(self, key: str) -> bool:
        return False

    def entry_tensor(self, key: str) -> torch.Tensor:
        return self.weights.mapped(key)


class SpillOrigin:
    """A safetensors file laid out for every weight of the model, filled in as the swap overwrites them."""

    kind = "spill"

    def __init__(self, path: str, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        import json

        header, offset = {}, 0
        for key, (dtype, shape) in layout.items():
            size = torch.Size(shape).numel() * dtype.itemsize
            header[key[len(MODEL_PREFIX):]] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                                               "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the header padded to 8 bytes, as safetensors writes it
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)  # sparse until written
        self.path = path
        self.id = ("spill", path)
        self.label = os.path.basename(path)
        self.weights = WeightsFile(path)
        self.written: set[str] = set()
        self.fd = os.open(path, os.O_WRONLY)
        weakref.finalize(self, os.close, self.fd)

    def needs_write(self, key: str) -> bool:
        return key not in self.written

    def write(self, key: str, tensor: torch.Tensor) -> None:
        info = self.weights.infos[key]
        if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
            raise RuntimeError(f"Swap Weights: {key} is {tensor.dtype} {list(tensor.shape)}, its spill slot "
                               f"{info.dtype} {list(info.shape)}")
        data = memoryview(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], info.start + done)
        self.written.add(key)

    def entry_tensor(self, key: str) -> torch.Tensor:
        return self.weights.mapped(key)


def _loader_file(patcher) -> str | None:
    """The file newer ComfyUI's loaders record on the patcher, to rebuild it (`cached_patcher_init`)."""
    init = getattr(patcher, "cached_patcher_init", None)
    if init and len(init) > 1 and init[1] and isinstance(init[1][0], str) and os.path.isfile(init[1][0]):
        return init[1][0]
    return None


def _verified(path: str, origin_value, shapes: dict) -> WeightsFile | None:
    """`path` as the model's original, if its header matches and sampled tensors equal the model's bit for bit
    (after the dtype conversion ComfyUI's loader makes)."""
    try:
        weights = WeightsFile(path)
        if not all(k in weights.infos and weights.shape(k) == shapes[k] for k in shapes):
            return None  # another architecture, or a file without some of the model's tensors
        weights.check_readable()
        keys = weights.keys()
        sample = keys[:: max(1, len(keys) // VERIFY_SAMPLES)][:VERIFY_SAMPLES] + keys[-1:]
        with weights.open() as reader:
            for key in sample:
                current = origin_value(key).detach().cpu().contiguous()
                loaded = reader.read(key).to(current.dtype)
                if not torch.equal(loaded.view(-1).view(torch.uint8), current.view(-1).view(torch.uint8)):
                    log.info("[Accel] Swap Weights: %s is not this model's original (%s differs)", weights.label, key)
                    return None
        return weights
    except (OSError, ValueError, RuntimeError) as err:
        log.info("[Accel] Swap Weights: cannot use %s as the model's original (%s)", path, err)
        return None


def resolve_origin(patcher, hints: list[str], origin_value, owner) -> KnownOrigin | SpillOrigin:
    """The store for this model's original weights: a verified source file, else a new spill file, deleted when
    `owner` (the model) is."""
    from .validate import model_shapes

    shapes = model_shapes(patcher)
    for path in [p for p in hints if p] + [_loader_file(patcher)]:
        if path:
            weights = _verified(path, origin_value, shapes)
            if weights is not None:
                log.info("[Accel] Swap Weights: the model's original weights come back from %s", weights.label)
                return KnownOrigin(weights)
    import folder_paths

    global _spill_count
    with _spill_lock:
        _spill_count += 1
        name = f"origin-{os.getpid()}-{_spill_count}.safetensors"
    path = os.path.join(folder_paths.get_temp_directory(), "accel-swap-weights", name)
    layout = {key: (origin_value(key).dtype, shapes[key]) for key in shapes}
    spill = SpillOrigin(path, layout)
    weakref.finalize(owner, _remove, path)  # deleted with the model (and at exit)
    log.info("[Accel] Swap Weights: the file this model was loaded from is unknown; its original weights are "
             "spilled to %s as they are replaced", path)
    return spill


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass

