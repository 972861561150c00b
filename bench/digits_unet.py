"""The UNet of the DeepCache quality benchmark (bench/deepcache_quality.py --model unet): a small class-conditional
ComfyUI UNetModel trained on scikit-learn's digits (8x8 images, upsampled to 16x16), sampled through ComfyUI's own
sampler. The class goes in as the cross-attention context (one learned token per digit, an eleventh for "no
class"), so sampling uses classifier-free guidance: cond and uncond batched, as with a text-to-image model."""
from __future__ import annotations

import math
import time

import _path  # noqa: F401  (the project root on sys.path)
from digits import NULL_CLASS, SIZE, Trainer, digit_classifier, digits, psnr, save_grid, to_features, trained_weights
from tools.comfy_env import ROOT
from tools.harness.sampling import sample

NAME = "deepcache_quality"
WEIGHTS = ROOT / "bench" / "assets" / "digits_unet.safetensors"
DEFAULTS = dict(train_steps=2000, batch=64, weights=WEIGHTS, steps=25, cfg=2.0, intervals=[1, 2, 3, 5])
CONTEXT_DIM = 64
# Three levels (16, 8, 4 pixels; 32, 32, 64 channels), one ResBlock each, attention (self and cross, on the class
# token) on the two lower levels and in the middle: the layout of SD1.5 at a toy scale (1.2 M parameters, about
# 100 MFLOP per image), so DeepCache has six skip branches to choose from and training takes minutes on a CPU.
DIGITS_UNET = dict(
    image_size=SIZE, in_channels=1, out_channels=1, model_channels=32, num_res_blocks=[1, 1, 1],
    channel_mult=[1, 1, 2], use_spatial_transformer=True, transformer_depth=[0, 1, 1],
    transformer_depth_middle=1, transformer_depth_output=[0, 0, 1, 1, 1, 1], context_dim=CONTEXT_DIM,
    use_linear_in_transformer=True, legacy=False, adm_in_channels=None, use_checkpoint=False,
    use_temporal_attention=False, use_temporal_resblock=False,
)


def model_config():
    """A ComfyUI model config for the digits UNet: EPS prediction on ComfyUI's default discrete schedule."""
    import torch
    from comfy import latent_formats, supported_models_base

    class DigitsLatent(latent_formats.LatentFormat):
        latent_channels = 1

    class DigitsConfig(supported_models_base.BASE):
        unet_extra_config = {"num_heads": 4, "num_head_channels": -1}
        latent_format = DigitsLatent

    config = DigitsConfig(dict(DIGITS_UNET))
    config.set_inference_dtype(torch.float32, None)
    return config


def build(weights: dict | None = None):
    """The ComfyUI model (BaseModel around UNetModel) and the class-token table: `weights`, or fresh init."""
    import torch

    model = model_config().get_model({}, device=torch.device("cpu"))
    tokens = torch.nn.Embedding(NULL_CLASS + 1, CONTEXT_DIM)
    if weights is None:
        # ComfyUI's layers skip weight init (they expect a checkpoint): use torch's default init instead.
        for module in model.diffusion_model.modules():
            for base in (torch.nn.Conv2d, torch.nn.Linear, torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.Embedding):
                if isinstance(module, base):
                    base.reset_parameters(module)
                    break
        torch.nn.init.normal_(tokens.weight, std=1.0)
    else:
        model.diffusion_model.load_state_dict({k[len("diffusion_model."):]: v for k, v in weights.items()
                                               if k.startswith("diffusion_model.")})
        tokens.weight.data.copy_(weights["class_tokens"])
    return model, tokens


def train(steps: int, batch: int, seed: int = 0) -> dict:
    """Plain DDPM training (eps prediction, ComfyUI's sigma parametrisation), class dropped 10 % of the time."""
    import torch

    torch.manual_seed(seed)
    model, tokens = build()
    images, labels, _, _ = digits()
    unet, sampling = model.diffusion_model, model.model_sampling
    unet.train()
    trainer = Trainer(list(unet.parameters()) + list(tokens.parameters()),
                      {**{f"diffusion_model.{k}": v for k, v in unet.state_dict().items()},
                       "class_tokens": tokens.weight}, steps, lr=2e-3)
    for step in range(steps):
        idx = torch.randint(0, len(images), (batch,))
        x0, y = images[idx], labels[idx].clone()
        y[torch.rand(batch) < 0.1] = NULL_CLASS
        t = torch.randint(0, 1000, (batch,))
        sigma = sampling.sigmas[t]
        noise = torch.randn_like(x0)
        x_in = sampling.calculate_input(sigma, x0 + noise * sigma.view(-1, 1, 1, 1))
        pred = unet(x_in, t.float(), context=tokens(y).unsqueeze(1))
        trainer.step(step, torch.nn.functional.mse_loss(pred, noise))
    return trainer.averaged()


def generate(patcher, tokens, per_class: int, steps: int, cfg: float, sampler: str):
    """`per_class` images of each digit through ComfyUI's sampler; digit d's seed is d, the same in every setting."""
    import torch

    images, targets = [], []
    for digit in range(10):
        conds = ([[tokens.weight[digit].detach().view(1, 1, -1), {}]],
                 [[tokens.weight[NULL_CLASS].detach().view(1, 1, -1), {}]])
        images.append(sample(patcher, conds, (per_class, 1, SIZE, SIZE), steps, cfg, sampler, seed=digit).out)
        targets += [digit] * per_class
    return torch.cat(images).clamp(-1, 1), targets


def evaluate(args, pack) -> tuple[dict, str | None]:
    """For each of `args.intervals` (DeepCache branch `--depth`, uniform schedule; 1 is full compute), `--per-class`
    images of each digit at fixed seeds: PSNR against full compute at the same seeds (mean over the images, pixels
    in [0, 1]) and the accuracy of the digit classifier on them, beside its accuracy on held-out real digits. The
    result, and no chart."""
    import comfy.model_patcher
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokens = build(trained_weights(args, train, DIGITS_UNET, "UNet"))
    patcher = comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
    classifier, real_accuracy = digit_classifier()
    print(f"== classifier accuracy on held-out real digits: {real_accuracy:.3f}", flush=True)

    rows, reference, generated = {}, None, {}
    for n in args.intervals:
        model_n = patcher if n == 1 else pack.nodes.deepcache.DeepCache().apply(patcher, n, args.depth, 0.0, 1.0,
                                                                              "uniform")[0]
        start = time.perf_counter()
        images, wanted = generate(model_n, tokens, args.per_class, args.steps, args.cfg, args.sampler)
        seconds = time.perf_counter() - start
        generated[n] = images
        if reference is None:
            reference = images  # the first setting (interval 1) is full compute
        accuracy = float((classifier.predict(to_features(images)) == wanted).mean())
        report = pack.accel.telemetry.snapshot()["events"][-1] if n > 1 else {}
        rows[n] = {"psnr_vs_full": psnr(images, reference), "accuracy": accuracy, "seconds": seconds,
                   "reused_steps": report.get("reused_steps", 0), "compute_skipped": report.get("compute_skipped", 0.0)}
        print(f"  interval {n}: PSNR {rows[n]['psnr_vs_full']:.2f} dB, accuracy {accuracy:.3f}, {seconds:.1f} s",
              flush=True)

    print("\n| interval | PSNR vs full (dB) | classifier accuracy | steps reused | UNet compute skipped (FLOPs) |")
    print("| --- | --- | --- | --- | --- |")
    for n, row in rows.items():
        p = "reference" if math.isinf(row["psnr_vs_full"]) else f"{row['psnr_vs_full']:.2f}"
        print(f"| {n} | {p} | {row['accuracy']:.3f} | {row['reused_steps']}/{args.steps} | "
              f"{100 * (row['compute_skipped'] or 0):.0f}% |")
    print(f"\nreal held-out digits: classifier accuracy {real_accuracy:.3f}; {10 * args.per_class} images per setting")
    if args.grid:
        save_grid(args.grid, generated)
        print(f"images: {args.grid} (intervals {', '.join(map(str, generated))}, left to right)")
    return {"images_per_setting": 10 * args.per_class, "steps": args.steps, "cfg": args.cfg, "sampler": args.sampler,
            "depth": args.depth, "classifier_accuracy_real": real_accuracy,
            "intervals": {n: {**row, "psnr_vs_full": None if math.isinf(row["psnr_vs_full"]) else row["psnr_vs_full"]}
                          for n, row in rows.items()}}, None
