"""DeepCache quality on a model that has learned something: a small class-conditional ComfyUI UNetModel trained on
scikit-learn's digits (8x8 images, upsampled to 16x16), sampled through ComfyUI's own sampler.

    python bench/deepcache_quality.py           # evaluate (trains first when the weights file is missing)
    python bench/deepcache_quality.py --train   # train again and overwrite bench/assets/digits_unet.safetensors

For interval 1, 2, 3 and 5 (DeepCache branch `--depth`, uniform schedule) it generates `--per-class` images of each
digit at fixed seeds and reports:
- PSNR against full compute (interval 1) at the same seeds, mean over the images (pixels in [0, 1]);
- the accuracy of a digit classifier (logistic regression on the same data set's training split) on them, beside
  its accuracy on the held-out real digits.

The class goes in as the cross-attention context (one learned token per digit, an eleventh for "no class"), so
sampling uses classifier-free guidance: cond and uncond batched, as with a text-to-image model.
Needs scikit-learn (bench/requirements.txt). Results: bench/results/deepcache_quality.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from tools.comfy_env import comfyui_version, import_comfyui, load_pack  # noqa: E402

WEIGHTS = ROOT / "bench" / "assets" / "digits_unet.safetensors"
SIZE = 16  # the 8x8 digits, upsampled
CONTEXT_DIM = 64
NULL_CLASS = 10  # the "no class" token of classifier-free guidance
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


def digits():
    """scikit-learn's digits as (N, 1, 16, 16) in [-1, 1], their labels, and the 8x8 features for the classifier."""
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    images = torch.nn.functional.interpolate(images, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    return images.clamp(-1, 1), torch.tensor(data.target), data.data, data.target


class Trainer:
    """What the digits benchmarks' training loops share: AdamW under a one-cycle schedule over `params`, gradients
    clipped to `clip` (None: not clipped), an exponential moving average of `tracked` (name -> tensor, updated in
    place by the optimizer) whose decay warms up as (1 + step) / (10 + step) to 0.999, and a progress line every
    `every` steps."""

    def __init__(self, params: list, tracked: dict, steps: int, lr: float, clip: float | None = None,
                 pct_start: float = 0.05, every: int = 200):
        import torch

        self.params, self.tracked, self.steps, self.clip, self.every = params, tracked, steps, clip, every
        for p in params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.OneCycleLR(self.optimizer, max_lr=lr, total_steps=steps,
                                                            pct_start=pct_start)
        self.average = {k: v.detach().clone() for k, v in tracked.items()}
        self.start = time.perf_counter()

    def step(self, step: int, loss) -> None:
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.schedule.step()
        with torch.no_grad():
            decay = min(0.999, (1 + step) / (10 + step))
            for name, value in self.tracked.items():
                self.average[name].mul_(decay).add_(value.detach(), alpha=1 - decay)
        if step % self.every == 0 or step == self.steps - 1:
            print(f"  step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - self.start:6.1f} s", flush=True)

    def averaged(self) -> dict:
        return {name: value.contiguous() for name, value in self.average.items()}


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
    import comfy.sample
    import torch

    images, targets = [], []
    for digit in range(10):
        pos = [[tokens.weight[digit].detach().view(1, 1, -1), {}]]
        neg = [[tokens.weight[NULL_CLASS].detach().view(1, 1, -1), {}]]
        latent = torch.zeros(per_class, 1, SIZE, SIZE)
        noise = comfy.sample.prepare_noise(latent, digit)
        images.append(comfy.sample.sample(patcher, noise, steps, cfg, sampler, "normal", pos, neg, latent,
                                          disable_pbar=True, seed=digit))
        targets += [digit] * per_class
    return torch.cat(images).clamp(-1, 1), targets


def to_features(images):
    """Generated 16x16 images in [-1, 1] as the classifier's 8x8 features (0..16, like the data set)."""
    import torch

    return ((torch.nn.functional.avg_pool2d(images, 2) + 1.0) * 8.0).flatten(1).numpy()


def save_grid(path: Path, settings: dict) -> None:
    """One panel per setting, side by side: a row per digit, `per_class` images across, pixels 2x."""
    import torch
    from PIL import Image

    panels = []
    for images in settings.values():
        rows = images.view(10, -1, SIZE, SIZE)  # digit, sample, h, w
        panel = rows.permute(0, 2, 1, 3).reshape(10 * SIZE, -1)  # digits down, samples across
        panels += [panel, torch.full((panel.shape[0], SIZE // 2), 1.0)]  # a white gap between panels
    grid = ((torch.cat(panels[:-1], dim=1) + 1.0) * 127.5).clamp(0, 255).to(torch.uint8)
    image = Image.fromarray(grid.numpy(), mode="L")
    image.resize((image.width * 2, image.height * 2), Image.NEAREST).save(path)


def psnr(a, b) -> float:
    """Mean PSNR over images, pixels mapped from [-1, 1] to [0, 1]."""
    mse = (((a - b) / 2.0) ** 2).flatten(1).mean(1)
    return float(sum(10 * math.log10(1.0 / m) if m > 0 else float("inf") for m in mse.tolist()) / len(mse))


def trained_weights(args, train_fn, config: dict, name: str) -> dict:
    """The weights at `args.weights`, trained first (`train_fn(steps, batch)`) when asked or missing."""
    from safetensors.torch import load_file, save_file

    if args.train or not args.weights.exists():
        print(f"== training the digits {name} ({args.train_steps} steps, batch {args.batch})", flush=True)
        start = time.perf_counter()
        weights = train_fn(args.train_steps, args.batch)
        args.weights.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(args.weights), metadata={"config": json.dumps(config),
                                                        "train_steps": str(args.train_steps), "batch": str(args.batch)})
        print(f"   wrote {args.weights} ({args.weights.stat().st_size / 2**20:.1f} MiB) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    return load_file(str(args.weights))


def digit_classifier():
    """Logistic regression on the data set's training split, and its accuracy on the held-out real digits."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    _, _, features, targets = digits()
    x_train, x_test, y_train, y_test = train_test_split(features, targets, test_size=0.25, random_state=0)
    classifier = LogisticRegression(max_iter=5000).fit(x_train, y_train)
    return classifier, classifier.score(x_test, y_test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="train again even if the weights exist")
    parser.add_argument("--train-steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--weights", type=Path, default=WEIGHTS)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--per-class", type=int, default=10, help="generated images per digit (10 digits)")
    parser.add_argument("--steps", type=int, default=25, help="sampling steps")
    parser.add_argument("--cfg", type=float, default=2.0)
    parser.add_argument("--sampler", default="euler")
    parser.add_argument("--depth", type=int, default=0, help="DeepCache branch")
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 3, 5])
    parser.add_argument("--grid", type=Path, help="also save the generated images as one PNG, a panel per interval")
    args = parser.parse_args()
    try:
        import sklearn  # noqa: F401
    except ImportError:  # a message, not an error: bench/run.py goes on with the other benchmarks
        print("deepcache_quality skipped: it needs scikit-learn. Install bench/requirements.txt into an environment "
              "of its own (not the project's .venv), see bench/README.md.")
        return

    comfy_dir = import_comfyui(cpu=True)
    pack = load_pack()
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
    result = {"benchmark": "deepcache_quality", "comfyui": comfyui_version(comfy_dir), "torch": torch.__version__,
              "images_per_setting": 10 * args.per_class, "steps": args.steps, "cfg": args.cfg, "sampler": args.sampler,
              "depth": args.depth, "classifier_accuracy_real": real_accuracy,
              "intervals": {n: {**row, "psnr_vs_full": None if math.isinf(row["psnr_vs_full"]) else row["psnr_vs_full"]}
                            for n, row in rows.items()}}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "deepcache_quality.json").write_text(json.dumps(result, indent=2))
    if args.grid:
        save_grid(args.grid, generated)
        print(f"images: {args.grid} (intervals {', '.join(map(str, generated))}, left to right)")


if __name__ == "__main__":
    main()
