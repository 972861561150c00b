"""The video model of the DeepCache quality benchmark (bench/deepcache_quality.py --model wan): a small
class-conditional Wan 2.1 (ComfyUI's own WanModel, built as comfy.supported_models.WAN21_T2V: dim 128, one head,
ffn 256, 6 blocks) trained by flow matching on clips of scikit-learn's digits (8x8) moving and turning on a 16x16
canvas over 8 frames (`--train`: 1400 steps, about 18 minutes on two cores), saved in ComfyUI's UNet layout,
loaded by ComfyUI's UNETLoader and sampled by ComfyUI's own sampler.

The weights are bench/assets/digits_wan21.safetensors (8 MiB, committed like the digits Flux; --weights elsewhere),
loaded through a model folder added for it. Detection reads the file back as WAN21_T2V. Wan's latent has 16
channels: a fixed seeded stand-in "VAE" maps a frame to them (a unit vector over the channels, at the mean and
spread of Wan 2.1's latent format) and back (its pseudo-inverse), so videos compare in pixel space. The class goes
in as four context tokens of umT5's width (4096), an eleventh "no class" entry for the uncond side: cfg with cond
and uncond batched. Training needs scikit-learn, evaluating an existing file does not.
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import _path  # noqa: F401  (the project root on sys.path)
from digits import NULL_CLASS, BlockWork, Trainer, digits, settings, trained_weights
from tools.comfy_env import ROOT
from tools.harness.sampling import sample

NAME = "deepcache_video_quality"
WEIGHTS = ROOT / "bench" / "assets" / "digits_wan21.safetensors"  # 8 MiB, committed as the other digits models are
DEFAULTS = dict(train_steps=1400, batch=16, weights=WEIGHTS, steps=24, cfg=5.0, intervals=[2, 3, 5],
                attention="pytorch")
EXTRA = "accel_digits."  # the class tokens and training record: a prefix ComfyUI's UNet loader leaves out
CANVAS = 16  # pixels (= latent positions: the stand-in VAE does not downsample)
CHANNELS = 16  # Wan 2.1's latent channels
CONTEXT_TOKENS = 4
TEXT_DIM = 4096  # umT5's width, Wan's text_embedding input
# What detection reads back from the weights (comfy/model_detection.py: num_heads = dim // 128, the rest fixed for
# Wan 2.1): one 128-wide head, 8 x 8 x 8 = 512 tokens for 8 frames at patch (1, 2, 2); 6 blocks, so that DeepCache
# (first and last block live) skips 4 of 6 on a reused step.
DIGITS_WAN = dict(
    image_model="wan2.1", model_type="t2v", dim=128, out_dim=CHANNELS, in_dim=CHANNELS, num_heads=1, ffn_dim=256,
    num_layers=6, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True,
    eps=1e-6,
)


class FrameVAE:
    """A fixed stand-in for Wan's VAE: latent = mean + 4 * std * u * frame (u a seeded unit vector over the 16
    channels; mean and std Wan 2.1's latent format's, as the real VAE's latents have them, so process_in hands
    the model 4 * u * frame, unit scale); decode is the map's pseudo-inverse, frames back in [0, 1]."""

    def __init__(self, latent_format, seed: int = 0):
        import torch

        u = torch.randn(CHANNELS, generator=torch.Generator().manual_seed(seed))
        self.mean = latent_format.latents_mean.view(1, CHANNELS, 1, 1, 1).float()
        self.weight = (4.0 * latent_format.latents_std.view(CHANNELS) * u / u.norm()).float()

    def encode(self, frames):  # (B, T, H, W) in [-1, 1] -> (B, 16, T, H, W)
        return self.mean + self.weight.view(1, CHANNELS, 1, 1, 1) * frames.unsqueeze(1)

    def decode(self, latent):  # (B, 16, T, H, W) -> (B, T, H, W) in [0, 1]
        import torch

        frames = torch.einsum("c,bcthw->bthw", self.weight, latent.float() - self.mean) / self.weight.square().sum()
        return (frames.clamp(-1, 1) + 1) / 2


def make_clips(ink, frames: int, generator):
    """(B, frames, CANVAS, CANVAS) in [-1, 1]: each 8x8 digit (`ink`, (B, 1, 8, 8) in [0, 1]) on the canvas, moving
    at a seeded constant velocity (0.5-1.25 px per frame, bouncing off the edges) and turning at a seeded angular
    speed (up to 15 degrees per frame) from a seeded angle (up to 20 degrees)."""
    import torch
    import torch.nn.functional as F

    b = len(ink)
    rand = functools.partial(torch.rand, generator=generator)
    reach = (CANVAS - 8) / 2  # how far (px) the digit's centre may move from the canvas centre
    heading = rand(b) * 2 * math.pi
    velocity = (0.5 + 0.75 * rand(b))[:, None] * torch.stack([heading.cos(), heading.sin()], 1)
    t = torch.arange(frames, dtype=torch.float32)
    position = (rand(b, 2) * 2 - 1)[:, None] * reach + velocity[:, None] * t[None, :, None]  # (B, T, 2)
    position = reach - ((position + reach) % (4 * reach) - 2 * reach).abs()  # reflected at +-reach: bouncing
    angle = (rand(b, 1) * 2 - 1) * math.radians(20) + (rand(b, 1) * 2 - 1) * math.radians(15) * t  # (B, T)
    cos, sin = angle.cos(), angle.sin()
    rotation = torch.stack([torch.stack([cos, sin], -1), torch.stack([-sin, cos], -1)], -2)  # R(-angle)
    shift = position.unsqueeze(-1) / (CANVAS / 2)  # normalised coordinates
    theta = torch.cat([rotation, -(rotation @ shift)], -1).flatten(0, 1)  # output point q <- R(-a) (q - c)
    grid = F.affine_grid(theta, [b * frames, 1, CANVAS, CANVAS], align_corners=False)
    canvas = F.pad(ink, [(CANVAS - 8) // 2] * 4).repeat_interleave(frames, 0)
    return F.grid_sample(canvas, grid, align_corners=False).view(b, frames, CANVAS, CANVAS) * 2 - 1


def build():
    """ComfyUI's WAN21 model (model_base.WAN21 around comfy.ldm.wan.model.WanModel) at DIGITS_WAN, like-init
    weights (tools/family_models.fill_family), on the CPU."""
    import torch
    from comfy import supported_models
    from tools.family_models import fill_family

    config = supported_models.WAN21_T2V(dict(DIGITS_WAN))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, device=torch.device("cpu"))
    model.diffusion_model.load_state_dict(fill_family(model.diffusion_model, seed=0))
    return model


def train(steps: int, batch: int, frames: int, seed: int = 0) -> dict:
    """Rectified flow in the model's space (x0 = process_in(VAE latent), what ComfyUI's sampler works in):
    x_t = t * noise + (1 - t) * x0, the model predicts noise - x0 (ComfyUI's FLOW model type), t uniform through
    Wan's shifted schedule (shift 8, as the "simple" scheduler steps it); the class dropped 10 % of the time."""
    import torch
    from tools.family_models import PREFIX, Family, check_detection

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = build()
    net, sampling, vae = model.diffusion_model, model.model_sampling, FrameVAE(model.latent_format)
    _, labels, features, _ = digits()
    ink = torch.tensor(features, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    tokens = torch.nn.Embedding(NULL_CLASS + 1, CONTEXT_TOKENS * TEXT_DIM)
    torch.nn.init.normal_(tokens.weight, std=1.0)
    net.train()
    trainer = Trainer(list(net.parameters()) + [tokens.weight],
                      {**{PREFIX + k: v for k, v in net.state_dict().items()}, EXTRA + "class_tokens": tokens.weight},
                      steps, lr=1e-3, clip=1.0, pct_start=max(0.05, 2 / steps), every=50)  # short runs: 2 warm-up steps
    for step in range(steps):
        idx = torch.randint(0, len(ink), (batch,))
        x0 = model.latent_format.process_in(vae.encode(make_clips(ink[idx], frames, generator)))
        y = labels[idx].clone()
        y[torch.rand(batch) < 0.1] = NULL_CLASS
        t = sampling.sigma(torch.rand(batch) * sampling.multiplier)
        noise = torch.randn_like(x0)
        x_t = t.view(-1, 1, 1, 1, 1) * noise + (1 - t.view(-1, 1, 1, 1, 1)) * x0
        velocity = net(x_t, sampling.timestep(t), context=tokens(y).view(batch, CONTEXT_TOKENS, TEXT_DIM))
        trainer.step(step, torch.nn.functional.mse_loss(velocity, noise - x0))
    seconds = time.perf_counter() - trainer.start
    out = trainer.averaged()
    check_detection(Family("digits-wan21", "WAN21_T2V", DIGITS_WAN),  # UNETLoader will read it as WAN21_T2V
                    {k[len(PREFIX):]: v for k, v in out.items() if k.startswith(PREFIX)})
    out[EXTRA + "training"] = torch.tensor([steps, batch, frames, seconds], dtype=torch.float64)
    return out


def generate(patcher, tokens, vae, clips_per_digit: int, frames: int, steps: int, cfg: float, sampler: str):
    """`clips_per_digit` clips of each digit through ComfyUI's sampler, as KSampler calls it (digit d's seed is d,
    the same in every setting), decoded: (clips, frames, H, W) in [0, 1]."""
    import torch

    def cond(label):
        return [[tokens[label].view(1, CONTEXT_TOKENS, TEXT_DIM), {}]]

    return torch.cat([vae.decode(sample(patcher, (cond(digit), cond(NULL_CLASS)),
                                        (clips_per_digit, CHANNELS, frames, CANVAS, CANVAS), steps, cfg, sampler,
                                        "simple", seed=digit).out) for digit in range(10)])


def frame_psnr(a, b):
    """PSNR (dB, peak 1) of every frame of (clips, T, H, W), flattened; capped at 100 dB (equal frames)."""
    import torch

    mse = (a - b).square().flatten(2).mean(-1).flatten()
    return 10 * torch.log10(1.0 / mse.clamp_min(1e-10))


def frame_ssim(a, b, size: int = 7, sigma: float = 1.5):
    """SSIM (Wang et al. 2004: Gaussian window, C1 = 0.01^2, C2 = 0.03^2 for pixels in [0, 1], the window's valid
    positions averaged) of every frame of (clips, T, H, W), flattened."""
    import torch
    import torch.nn.functional as F

    g = torch.exp(-(torch.arange(size) - size // 2).float().square() / (2 * sigma ** 2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :]).view(1, 1, size, size)
    x, y = (v.reshape(-1, 1, *v.shape[-2:]).double() for v in (a, b))
    blur = functools.partial(F.conv2d, weight=window.double())
    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    ssim = (2 * mx * my + c1) * (2 * cov + c2) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return ssim.flatten(1).mean(1).float()


def save_strip(path: Path, videos: dict, scale: int = 4) -> None:
    """One row per setting (its name at the left), the clip's frames across, pixels `scale`x."""
    from PIL import Image, ImageDraw

    frames, height, width = next(iter(videos.values())).shape
    label, gap = 160, 2
    strip = Image.new("L", (label + frames * (width * scale + gap), len(videos) * (height * scale + gap)), 255)
    draw = ImageDraw.Draw(strip)
    for row, (name, video) in enumerate(videos.items()):
        top = row * (height * scale + gap)
        draw.text((4, top + height * scale // 2 - 6), name, fill=0)
        for t in range(frames):
            frame = Image.fromarray((video[t] * 255).round().byte().numpy()).resize((width * scale, height * scale),
                                                                                   Image.NEAREST)
            strip.paste(frame, (label + t * (width * scale + gap), top))
    strip.save(path)


def needs_sklearn(args) -> bool:
    return args.train or not args.weights.exists()  # training does, evaluating an existing file does not


def evaluate(args, pack) -> tuple[dict, str]:
    """Full compute, then each setting (digits.settings) on the same model, seeds, sampler and steps, in this one
    process. Per setting, against full compute at the same seeds (pixels in [0, 1]): PSNR and SSIM (Gaussian window
    7, sigma 1.5) of every frame, mean and worst frame; the temporal error, PSNR of the frame-to-frame differences
    d_t = f(t+1) - f(t) (a static error cancels, flicker does not); the share of the blocks' compute skipped and the
    speedup it allows; wall time: after one untimed generation of every setting, `--rounds` rounds over all
    settings, each timing one generation of all the clips; the median, and the speedup against full compute's
    median. `--strip` saves one clip's frames for full compute, DeepCache (adaptive 0.2, interval 3) and EasyCache
    0.2. The result, and the chart's title."""
    import folder_paths
    import nodes
    import torch

    # where UNETLoader will look first, as an extra_model_paths.yaml entry would make it
    args.weights = args.weights.resolve()
    folder_paths.add_model_folder_path("diffusion_models", str(args.weights.parent), is_default=True)
    weights = trained_weights(args, functools.partial(train, frames=args.frames), {**DIGITS_WAN, "frames": args.frames},
                              "Wan 2.1")
    tokens = weights[EXTRA + "class_tokens"].view(NULL_CLASS + 1, CONTEXT_TOKENS, TEXT_DIM)
    train_steps, train_batch, train_frames, train_seconds = weights[EXTRA + "training"].tolist()
    del weights
    patcher = nodes.UNETLoader().load_unet(args.weights.name, "default")[0]  # ComfyUI's detection and loader
    assert type(patcher.model).__name__ == "WAN21", type(patcher.model).__name__
    net = patcher.model.diffusion_model
    vae = FrameVAE(patcher.model.latent_format)
    parameters = sum(p.numel() for p in net.parameters())
    clips = 10 * args.clips_per_digit
    print(f"== {args.weights.name}: {type(patcher.model).__name__}, {parameters / 1e6:.2f} M parameters "
          f"({next(net.parameters()).dtype}), trained {int(train_steps)} steps at batch {int(train_batch)} in "
          f"{train_seconds / 60:.1f} min; {clips} clips of {args.frames} frames, {args.steps} steps {args.sampler}, "
          f"cfg {args.cfg:g}, {torch.get_num_threads()} threads", flush=True)

    work = BlockWork(SimpleNamespace(double_blocks=net.blocks, single_blocks=()))  # Wan has one block list
    cases = settings(pack, patcher, args)
    videos, block_work = {}, {}
    for name, _, _, model in cases:  # untimed: warm-up, the videos and the blocks' work
        work.total = 0.0
        videos[name] = generate(model, tokens, vae, args.clips_per_digit, args.frames, args.steps, args.cfg,
                                args.sampler)
        block_work[name] = work.total
        print(f"  generated: {name}", flush=True)
    work.close()
    times = {name: [] for name, *_ in cases}
    for round_ in range(args.rounds):  # interleaved: a drift of the machine's speed spreads over every setting
        for name, _, _, model in cases:
            start = time.perf_counter()
            generate(model, tokens, vae, args.clips_per_digit, args.frames, args.steps, args.cfg, args.sampler)
            times[name].append(time.perf_counter() - start)
        print(f"  round {round_ + 1}/{args.rounds}: " + ", ".join(f"{t[-1]:.1f}" for t in times.values()) + " s",
              flush=True)

    reference, full = videos[cases[0][0]], cases[0][0]
    rows = []
    for name, method, knob, _ in cases:
        video, seconds = videos[name], statistics.median(times[name])
        equal = bool(torch.equal(video, reference))
        psnr, ssim = frame_psnr(video, reference), frame_ssim(video, reference)
        temporal = frame_psnr(video.diff(dim=1), reference.diff(dim=1))
        skipped = 1.0 - block_work[name] / block_work[full]
        rows.append({
            "setting": name, "method": method, "knob": knob, "seconds": seconds, "times": times[name],
            "speedup": statistics.median(times[full]) / seconds, "block_compute_skipped": skipped,
            "speedup_limit": 1.0 / (1.0 - skipped) if skipped < 1 else None, "equal_to_full": equal,
            "psnr_vs_full": None if equal else psnr.mean().item(),
            "psnr_worst_frame": None if equal else psnr.min().item(),
            "ssim_vs_full": ssim.mean().item(), "ssim_worst_frame": ssim.min().item(),
            "temporal_psnr_vs_full": None if equal else temporal.mean().item(),
        })

    def db(value):
        return f"{value:.2f}" if value is not None else "-"

    print("\n| setting | speedup (wall) | block compute skipped | its speedup limit | PSNR vs full (dB) | "
          "worst frame (dB) | SSIM vs full | worst frame | temporal PSNR (dB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        quality = ("reference" if row["method"] == "full" else "equal to full") if row["equal_to_full"] else None
        cells = [quality] * 5 if quality else [db(row["psnr_vs_full"]), db(row["psnr_worst_frame"]),
                                               f"{row['ssim_vs_full']:.4f}", f"{row['ssim_worst_frame']:.4f}",
                                               db(row["temporal_psnr_vs_full"])]
        print(f"| {row['setting']} | {row['speedup']:.2f}x | {100 * row['block_compute_skipped']:.1f}% | "
              f"{row['speedup_limit'] or 0:.2f}x | " + " | ".join(cells) + " |")
    print(f"\n{clips} clips x {args.frames} frames per setting; wall time: median of {args.rounds} interleaved "
          f"rounds, full compute {statistics.median(times[full]):.1f} s per generation")
    if args.strip:
        shown = [n for n in ("full compute", "DeepCache adaptive 0.2", "DeepCache interval 3", "EasyCache 0.2")
                 if n in videos]
        save_strip(args.strip, {n: videos[n][0] for n in shown})
        print(f"frames of the first clip (digit 0): {args.strip} ({', '.join(shown)}, top to bottom)")
    return ({"model": {"class": "comfy.ldm.wan.model.WanModel", "comfy_model": type(patcher.model).__name__,
                       "detected_as": "WAN21_T2V", "config": DIGITS_WAN, "parameters": parameters,
                       "file": args.weights.name, "context_tokens": CONTEXT_TOKENS,
                       "training": {"steps": int(train_steps), "batch": int(train_batch), "frames": int(train_frames),
                                    "seconds": train_seconds}},
             "clips_per_setting": clips, "frames": args.frames, "canvas": CANVAS, "steps": args.steps,
             "cfg": args.cfg, "sampler": args.sampler, "scheduler": "simple", "rounds": args.rounds,
             "depth": args.depth, "adaptive_interval": args.adaptive_interval, "attention": args.attention,
             "torch_threads": torch.get_num_threads(), "settings": rows},
            f"digits Wan 2.1 video ({parameters / 1e6:.1f} M), {args.steps} steps {args.sampler}, cfg {args.cfg:g}, "
            f"{clips} clips x {args.frames} frames; labels: interval or threshold")
