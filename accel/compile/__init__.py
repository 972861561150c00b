"""Compile Model engine: regional torch.compile behind a process-wide compiled-graph registry.

Public entry points:
- `CompileOptions`: what the user chose (mode, dynamic shapes, scope), validated.
- `compile_model(patcher, options)`: a ModelPatcher clone whose diffusion model runs its repeated blocks compiled.
- `compile_vae(vae, options)`: a copy of a ComfyUI VAE that encodes and decodes compiled.
- `REGISTRY.stats()`: compiles, recompiles (with the guard that failed), cache hits, compile seconds, chosen paths.

Nothing is compiled when these are called: compilation happens at the first sampling call that needs it.
"""
from .options import CompileOptions
from .patcher import compile_model
from .registry import REGISTRY
from .vae import compile_vae

__all__ = ["CompileOptions", "compile_model", "compile_vae", "REGISTRY"]
