"""Sampling for the benchmarks: ComfyUI's sampler as its KSampler node calls it, timed as a whole and step by step,
and prompt conditioning fed as tensors of a model's widths (no text encoder: a Flux one is gigabytes)."""
from __future__ import annotations

import time
from dataclasses import dataclass


def synced_clock() -> float:
    """perf_counter once the GPU (if any) has finished what was queued: a step's time is its work's."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def conditioning(width: int = 768, tokens: int = 77, pooled: bool = False, seed: int = 0):
    """(positive, negative): `tokens` prompt states of `width` drawn from a generator seeded `seed` (768: SD1.5's
    CLIP; 4096: T5 or umT5), the negative zeros; with `pooled`, Flux's pooled CLIP-L vector (drawn next) and
    guidance 3.5 as inputs, the negative's pooled vector zeros."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    context = torch.randn(1, tokens, width, generator=generator)
    if not pooled:
        return [[context, {}]], [[torch.zeros_like(context), {}]]
    extras = {"pooled_output": torch.randn(1, 768, generator=generator), "guidance": 3.5}
    return ([[context, extras]],
            [[torch.zeros_like(context), {"pooled_output": torch.zeros(1, 768), "guidance": 3.5}]])


@dataclass
class Sampled:
    out: object  # the sampled latent
    seconds: float  # the whole sampling
    step_s: list[float]  # each step's seconds, the first one's from the sampling's start


def sample(model, conds, shape, steps: int, cfg: float, sampler: str = "euler", scheduler: str = "normal",
           seed: int = 0) -> Sampled:
    """`steps` steps from a zero latent of `shape` and the noise of `seed`, through comfy.sample.sample (what
    KSampler calls), with `conds` = (positive, negative). Its callback fires after each step: the step times."""
    import comfy.sample
    import torch

    latent = torch.zeros(shape)
    noise = comfy.sample.prepare_noise(latent, seed)
    start = time.perf_counter()
    stamps = [start]
    out = comfy.sample.sample(model, noise, steps, cfg, sampler, scheduler, *conds, latent, disable_pbar=True,
                              seed=seed, callback=lambda *a: stamps.append(synced_clock()))
    return Sampled(out, synced_clock() - start, [b - a for a, b in zip(stamps, stamps[1:])])
