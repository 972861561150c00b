"""Sampling for the benchmarks: ComfyUI's sampler as its KSampler node calls it, timed as a whole and step by step,
prompt conditioning fed as tensors of a model's widths (no text encoder: a Flux one is gigabytes), settings timed
in rounds, and the blocks' compute counted by hooks."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


def synced_clock() -> float:
    """perf_counter once the GPU (if any) has finished what was queued: a step's time is its work's."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def timed(run) -> tuple[float, list[float]]:
    """Wall time of `run(callback)` and the time of each step (the callback fires after every step; the first
    step's time counts from the start)."""
    start = time.perf_counter()
    stamps = [start]
    run(lambda *a, **k: stamps.append(synced_clock()))
    return synced_clock() - start, [b - a for a, b in zip(stamps, stamps[1:])]


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
    out = []
    seconds, step_s = timed(lambda callback: out.append(comfy.sample.sample(
        model, noise, steps, cfg, sampler, scheduler, *conds, latent, disable_pbar=True, seed=seed, callback=callback)))
    return Sampled(out[0], seconds, step_s)


def run_settings(cases, generate, observe, repeats: int = 0, rounds: int = 0):
    """Each setting's output, what `observe()` read after its generation, its median seconds and its times:
    `repeats` timed generations of each setting in a row (the last one's output kept), or one generation of each
    (the warm-up: the first of its times, left out of the median), then `rounds` rounds over all the settings (a
    drift of the machine's speed over minutes then spreads over every setting, instead of landing on one)."""
    outputs, observed, times = {}, {}, {name: [] for name, *_ in cases}

    def once(name, model):
        start = time.perf_counter()
        outputs[name] = generate(model)
        times[name].append(time.perf_counter() - start)
        observed[name] = observe()

    for name, _, _, model in cases:
        for _ in range(repeats or 1):
            once(name, model)
        print(f"  {name}: {', '.join(f'{t:.1f}' for t in times[name])} s", flush=True)
    for round_ in range(0 if repeats else rounds):
        for name, _, _, model in cases:
            once(name, model)
        print(f"  round {round_ + 1}/{rounds}: " + ", ".join(f"{t[-1]:.1f}" for t in times.values()) + " s",
              flush=True)
    return outputs, observed, {name: statistics.median(t[0 if repeats else 1:]) for name, t in times.items()}, times


class BlockWork:
    """Counts the samples each transformer block processes (forward pre-hooks: they read the batch size and
    change nothing), weighted by the block's parameters: the blocks' compute, in parameter-samples."""

    def __init__(self, *block_lists):
        self.total = 0.0
        self.handles = []
        for blocks in block_lists:
            for block in blocks:
                size = sum(p.numel() for p in block.parameters())
                self.handles.append(block.register_forward_pre_hook(self._hook(size), with_kwargs=True))

    def _hook(self, size: int):
        def count(module, args, kwargs):
            first = args[0] if args else kwargs.get("img", kwargs.get("x"))
            self.total += size * first.shape[0]
        return count

    def close(self):
        for handle in self.handles:
            handle.remove()

    def take(self) -> float:
        """The blocks' compute since the last call (run_settings' `observe`)."""
        total, self.total = self.total, 0.0
        return total
