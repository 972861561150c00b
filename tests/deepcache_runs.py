"""Sampling runs shared by test_deepcache.py and its fresh-process check.

    python tests/deepcache_runs.py OUT.pt   # in a fresh process: load ComfyUI and the pack, save run A's latent

Everything goes through ComfyUI's own loader and sampler (`comfy.sample.sample`, as KSampler calls it).
"""
from __future__ import annotations

import sys
from pathlib import Path

from compile_helpers import SMALL

ROOT = Path(__file__).resolve().parent.parent
RUN_A = dict(size=(16, 16), batch=1, steps=6, seed=0, interval=3, depth=1)


def conds(seed: int = 0):
    """Positive and negative conditioning like CLIPTextEncode's output (random, so no text encoder is needed)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + seed)
    return [[torch.randn(1, 77, 768, generator=gen), {}]], [[torch.randn(1, 77, 768, generator=gen), {}]]


def sample(model, size=(16, 16), batch=1, steps=6, seed=0, cfg=5.0, sampler="euler", scheduler="normal",
           latent=None, denoise=1.0, callback=None):
    import comfy.sample

    import torch

    if latent is None:
        latent = torch.zeros(batch, 4, *size)
    pos, neg = conds(seed)
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, steps, cfg, sampler, scheduler, pos, neg, latent, denoise=denoise,
                               callback=callback, disable_pbar=True, seed=seed)


def deepcache(pack, model, interval=3, depth=0, start=0.0, end=1.0, schedule="uniform"):
    (out,) = pack.nodes.deepcache.DeepCache().apply(model, interval, depth, start, end, schedule)
    return out


def split_cond_uncond(model):
    """A clone of `model` on which cond and uncond always reach the UNet in separate calls.

    ComfyUI's `_calc_cond_batch` concatenates the cond and uncond chunks into one UNet call when
    `model.memory_required(batched shape) * 1.5 < free memory`, and otherwise falls back to one call per
    chunk. On a machine with memory to spare that fallback is reached through a public CALC_COND_BATCH
    wrapper: it hands ComfyUI's own `_calc_cond_batch` one cond list at a time (the other set to None), so
    each UNet call carries exactly one chunk with its own `cond_or_uncond` and `uuids`, uncond first, as the
    memory fallback does. (Raising `memory_usage_factor` through `add_object_patch` reaches the fallback
    too, but the value stays on the shared BaseModel after the run until the model is unloaded; the test
    uses it once, to check that both give the same result.)
    """
    import comfy.patcher_extension as pe

    def one_cond_per_call(executor, model_, conds_, x_in, timestep, model_options):
        outs = [None] * len(conds_)
        for i in reversed(range(len(conds_))):
            only = [c if j == i else None for j, c in enumerate(conds_)]
            outs[i] = executor(model_, only, x_in, timestep, model_options)[i]
        return outs

    clone = model.clone()
    clone.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, "test_split_cond_uncond", one_cond_per_call)
    return clone


def run_a(pack, model):
    """Run A of the state-leak test: DeepCache interval 3, branch 1, 16x16, batch 1, cond and uncond batched."""
    spec = RUN_A
    return sample(deepcache(pack, model, spec["interval"], spec["depth"]), spec["size"], spec["batch"],
                  spec["steps"], spec["seed"])


def load_pack():
    """ComfyUI in this process, and the pack loaded by ComfyUI's own custom-node loader (as conftest does)."""
    sys.path.append(str(ROOT))
    from tools.comfy_env import load_pack as load

    return load()


if __name__ == "__main__":
    import torch

    pack = load_pack()
    import nodes

    (unet,) = nodes.UNETLoader().load_unet(SMALL, "default")
    torch.save(run_a(pack, unet), sys.argv[1])
