"""ComfyUI-Accel engine: compile cache, DeepCache, weight swap, hardware policy, telemetry.

This package knows nothing about ComfyUI node schemas (those live in `nodes/`). Importing it is cheap:
no torch.compile, no model work, and no change to any torch, transformers or ComfyUI global.
"""

__version__ = "0.1.0"
