"""The DiT of the DeepCache quality benchmark (bench/deepcache_quality.py --model flux): a small class-conditional
Flux (ComfyUI's own Flux class at 128 wide, 3 double + 3 single stream blocks, 2.6 M parameters) trained by flow
matching on scikit-learn's digits (8x8, upsampled to 16x16), sampled by ComfyUI's own sampler. The class goes in
as four context tokens and the pooled vector (an eleventh "no class" entry for the uncond side), so sampling uses
classifier-free guidance with cond and uncond batched, as a text-to-image Flux run does at cfg > 1."""
from __future__ import annotations

import math
import statistics
import time

import _path  # noqa: F401  (the project root on sys.path)
from digits import (NULL_CLASS, SIZE, BlockWork, Trainer, digit_classifier, digits, psnr, save_grid, settings,
                    to_features, trained_weights)
from tools.comfy_env import ROOT
from tools.harness.sampling import sample

NAME = "deepcache_dit_quality"
WEIGHTS = ROOT / "bench" / "assets" / "digits_flux.safetensors"
DEFAULTS = dict(train_steps=1500, batch=48, weights=WEIGHTS, steps=20, cfg=3.0, intervals=[2, 3, 5])
CONTEXT_DIM = 32
CONTEXT_TOKENS = 4
# Flux's layout at a toy scale: 4 heads of 32 (rope axes 8 + 12 + 12), patch 2 (64 image tokens), one latent
# channel; no guidance embedding (the uncond side is the "no class" entry, as with cfg on a text model).
DIGITS_FLUX = dict(
    image_model="flux", in_channels=1, out_channels=1, vec_in_dim=CONTEXT_DIM, context_in_dim=CONTEXT_DIM,
    hidden_size=128, mlp_ratio=4.0, num_heads=4, depth=3, depth_single_blocks=3, axes_dim=[8, 12, 12],
    theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False,
)


def model_config():
    """ComfyUI's Flux model config, with a one-channel latent: flow matching on Flux's shifted schedule."""
    import torch
    from comfy import latent_formats, supported_models
    from tools.family_models import config_for_this_comfyui

    class DigitsLatent(latent_formats.LatentFormat):
        latent_channels = 1

    class DigitsFlux(supported_models.Flux):
        latent_format = DigitsLatent

    config = DigitsFlux(config_for_this_comfyui(DIGITS_FLUX))
    config.set_inference_dtype(torch.float32, None)
    return config


class ClassConditioning:
    """The digit as a text model's outputs: CONTEXT_TOKENS context tokens and a pooled vector, learned per class."""

    def __init__(self, weights: dict | None = None):
        import torch

        self.tokens = torch.nn.Embedding(NULL_CLASS + 1, CONTEXT_TOKENS * CONTEXT_DIM)
        self.pooled = torch.nn.Embedding(NULL_CLASS + 1, CONTEXT_DIM)
        if weights is not None:
            self.tokens.weight.data.copy_(weights["class_tokens"])
            self.pooled.weight.data.copy_(weights["class_pooled"])

    def parameters(self):
        return [self.tokens.weight, self.pooled.weight]

    def __call__(self, labels):
        return self.tokens(labels).view(len(labels), CONTEXT_TOKENS, CONTEXT_DIM), self.pooled(labels)

    def conds(self, label: int, batch: int):
        import torch

        context, pooled = self(torch.full((batch,), label))
        return [[context.detach(), {"pooled_output": pooled.detach()}]]


def build(weights: dict | None = None):
    """The ComfyUI model (model_base.Flux) and its class conditioning: `weights`, or a fresh init."""
    import torch
    from tools.family_models import fill_family

    model = model_config().get_model({}, device=torch.device("cpu"))
    net = model.diffusion_model
    if weights is None:  # ComfyUI's layers skip init (they expect a checkpoint): like-init values, norms at one
        net.load_state_dict(fill_family(net, seed=0))
        conditioning = ClassConditioning()
        torch.nn.init.normal_(conditioning.tokens.weight, std=1.0)
        torch.nn.init.normal_(conditioning.pooled.weight, std=1.0)
    else:
        net.load_state_dict({k[len("diffusion_model."):]: v for k, v in weights.items()
                             if k.startswith("diffusion_model.")})
        conditioning = ClassConditioning(weights)
    return model, conditioning


def train(steps: int, batch: int, seed: int = 0) -> dict:
    """Rectified flow: x_t = t * noise + (1 - t) * x0, the model predicts noise - x0 (what ComfyUI's FLUX model
    type turns into a denoised image), t logit-normal; the class dropped 10 % of the time."""
    import torch

    torch.manual_seed(seed)
    model, conditioning = build()
    images, labels, _, _ = digits()
    net = model.diffusion_model
    net.train()
    class_tokens, class_pooled = conditioning.parameters()
    trainer = Trainer(list(net.parameters()) + conditioning.parameters(),
                      {**{f"diffusion_model.{k}": v for k, v in net.state_dict().items()},
                       "class_tokens": class_tokens, "class_pooled": class_pooled}, steps, lr=1e-3, clip=1.0)
    for step in range(steps):
        idx = torch.randint(0, len(images), (batch,))
        x0, y = images[idx], labels[idx].clone()
        y[torch.rand(batch) < 0.1] = NULL_CLASS
        t = torch.sigmoid(torch.randn(batch))
        noise = torch.randn_like(x0)
        x_t = t.view(-1, 1, 1, 1) * noise + (1 - t.view(-1, 1, 1, 1)) * x0
        # ComfyUI's Flux blocks add into their inputs in place (inference code): autograd keeps a copy of what
        # they overwrite instead of failing.
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            context, pooled = conditioning(y)
            velocity = net(x_t, model.model_sampling.timestep(t), context=context, y=pooled)
            trainer.step(step, torch.nn.functional.mse_loss(velocity, noise - x0))
    return trainer.averaged()


def generate(patcher, conditioning, per_class: int, steps: int, cfg: float, sampler: str):
    """`per_class` images of each digit through ComfyUI's sampler; digit d's seed is d, the same in every setting."""
    import torch

    images, targets = [], []
    for digit in range(10):
        conds = conditioning.conds(digit, per_class), conditioning.conds(NULL_CLASS, per_class)
        images.append(sample(patcher, conds, (per_class, 1, SIZE, SIZE), steps, cfg, sampler, "simple",
                             seed=digit).out)
        targets += [digit] * per_class
    return torch.cat(images).clamp(-1, 1), targets


def evaluate(args, pack) -> tuple[dict, str]:
    """Full compute, then each setting (digits.settings) on the same model, seeds, sampler and steps, in this one
    process: wall time (median of `--repeats` generations of all the images) and the speedup against full compute;
    the share of the blocks' compute skipped (BlockWork) and its limit on the speedup, 1 / (1 - share); mean PSNR
    against full compute at the same seeds (pixels in [0, 1]); the digit classifier's accuracy on the images. The
    result, and the chart's title."""
    import comfy.model_patcher
    import torch

    model, conditioning = build(trained_weights(args, train, DIGITS_FLUX, "Flux"))
    patcher = comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
    parameters = sum(p.numel() for p in model.diffusion_model.parameters())
    classifier, real_accuracy = digit_classifier()
    print(f"== {parameters / 1e6:.2f} M parameters; classifier accuracy on held-out real digits: {real_accuracy:.3f}",
          flush=True)

    work = BlockWork(model.diffusion_model)
    rows, reference, full_work, generated = [], None, None, {}
    for name, method, knob, setting in settings(pack, patcher, args):
        times = []
        for _ in range(args.repeats):
            work.total = 0.0
            start = time.perf_counter()
            images, wanted = generate(setting, conditioning, args.per_class, args.steps, args.cfg, args.sampler)
            times.append(time.perf_counter() - start)
        if reference is None:
            reference, full_work, full_time = images, work.total, statistics.median(times)
        seconds = statistics.median(times)
        skipped = 1.0 - work.total / full_work
        row = {"setting": name, "method": method, "knob": knob, "seconds": seconds, "speedup": full_time / seconds,
               "block_compute_skipped": skipped, "speedup_limit": 1.0 / (1.0 - skipped) if skipped < 1 else None,
               "psnr_vs_full": psnr(images, reference),
               "accuracy": float((classifier.predict(to_features(images)) == wanted).mean())}
        rows.append(row)
        generated[name] = images
        print(f"  {name:24s} {seconds:6.2f} s  x{row['speedup']:.2f} (limit x{row['speedup_limit'] or 0:.2f})  "
              f"skipped {100 * skipped:4.1f}%  PSNR {row['psnr_vs_full']:6.2f} dB  accuracy {row['accuracy']:.3f}",
              flush=True)
    work.close()

    print("\n| setting | speedup (wall) | block compute skipped | its speedup limit | PSNR vs full (dB) "
          "| classifier accuracy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        p = ("reference" if row["method"] == "full" else "equal to full") if math.isinf(row["psnr_vs_full"]) \
            else f"{row['psnr_vs_full']:.2f}"
        print(f"| {row['setting']} | {row['speedup']:.2f}x | {100 * row['block_compute_skipped']:.1f}% | "
              f"{row['speedup_limit']:.2f}x | {p} | {row['accuracy']:.3f} |")
    print(f"\nreal held-out digits: classifier accuracy {real_accuracy:.3f}; {10 * args.per_class} images per setting")
    for row in rows:
        row["psnr_vs_full"] = None if math.isinf(row["psnr_vs_full"]) else row["psnr_vs_full"]
    if args.grid:
        shown = [r["setting"] for r in rows if r["method"] == "full" or r["knob"] in (3, 0.2)]
        save_grid(args.grid, {name: generated[name] for name in shown})
        print(f"images: {args.grid} ({', '.join(shown)}, left to right)")
    return ({"model": {"class": "comfy.ldm.flux.model.Flux", "config": DIGITS_FLUX, "parameters": parameters},
             "images_per_setting": 10 * args.per_class, "steps": args.steps, "cfg": args.cfg,
             "sampler": args.sampler, "scheduler": "simple", "repeats": args.repeats, "depth": args.depth,
             "adaptive_interval": args.adaptive_interval, "classifier_accuracy_real": real_accuracy,
             "torch_threads": torch.get_num_threads(), "settings": rows},
            f"digits Flux ({parameters / 1e6:.1f} M), {args.steps} steps euler, cfg {args.cfg:g}, "
            f"{10 * args.per_class} images; labels: interval or threshold")
