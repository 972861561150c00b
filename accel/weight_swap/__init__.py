"""Swap Weights engine: another checkpoint's weights into a (compiled) model, as one in-place weight copy.

Public entry points:
- `WeightsFile(path)`: a safetensors checkpoint or diffusion-model file, indexed from its header;
  `file_identity(path)`: what tells a file rewritten under its name from the one read before.
- `ModelWeights(patcher)`: another MODEL's base weights.
- `swap_weights(patcher, source, origin_hints)`: a clone that loads with `source`'s weights; raises ValueError
  (nothing changed) when they do not fit. `swap_from_model(patcher, weights_model)`: the same from a MODEL.
- `SWAP_LOCK`: held by every swap, process-wide.

How it works: ledger.py (the swap and its journal in ComfyUI's backup), origin.py (the original weights, on disk),
sources.py (streaming reads from files), model_source.py (from another MODEL), validate.py (the architecture
check), patcher.py (ComfyUI hooks).
"""
from .patcher import SWAP_LOCK, plan_of, swap_from_model, swap_weights
from .model_source import ModelWeights
from .sources import WeightsFile, file_identity

__all__ = ["SWAP_LOCK", "ModelWeights", "WeightsFile", "file_identity", "plan_of", "swap_from_model", "swap_weights"]
