"""A swap's source that is another MODEL (a second loader's output) rather than a file: its base weights, which
the ledger knows how to read while that model is itself swapped or patched."""
from __future__ import annotations

import torch

from .ledger import base_value
from .sources import MODEL_PREFIX


class ModelWeights:
    """The base weights of another MODEL (a second loader's output): what its loader loaded, without its LoRA or
    other weight patches, read from its own parameters or, while ComfyUI has it patched, from ComfyUI's backup."""

    kind = "model"

    def __init__(self, patcher, label: str = "weights_model"):
        self.patcher = patcher  # kept alive while the swapped model exists: these are its weights
        self.label = f"{label} ({type(patcher.model).__name__})"
        self.id = ("model", id(patcher.model))
        state = patcher.model.diffusion_model.state_dict(keep_vars=True)
        self._shapes = {MODEL_PREFIX + k: tuple(v.shape) for k, v in state.items()}

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def check_readable(self) -> None:
        pass

    def open(self) -> "ModelWeights":
        return self

    def read(self, key: str) -> torch.Tensor:
        return base_value(self.patcher, key)  # the other model may itself be a swapped model's module

    mapped = read

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass
