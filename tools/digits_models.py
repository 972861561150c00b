"""The three small class-conditional models of bench/deepcache_quality.py, trained on scikit-learn's digits: the
data, one training loop with each model's objective, the weights file (trained when missing), the sampling, and
the blocks' compute counted by hooks. Each model is ComfyUI's own class (bench/README.md describes them). Here in
tools/ with the rest of the code that makes models (make_models.py, family_models.py): it trains, it does not
measure; the benchmarks that measure them are bench/deepcache_quality.py and bench/cache_rules_explained.py."""
from __future__ import annotations

import functools
import json
import math
import time
from contextlib import nullcontext

from tools.comfy_env import ROOT
from tools.harness.sampling import sample

SIZE = 16  # the 8x8 digits, upsampled
NULL_CLASS = 10  # the "no class" entry of classifier-free guidance
ASSETS = ROOT / "bench" / "assets"


def digits():
    """scikit-learn's digits as (N, 1, 16, 16) in [-1, 1], their labels, and the 8x8 features for the classifier."""
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    images = torch.nn.functional.interpolate(images, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    return images.clamp(-1, 1), torch.tensor(data.target), data.data, data.target


class Trainer:
    """AdamW under a one-cycle schedule over `params`, gradients clipped to `clip` (None: not clipped), an
    exponential moving average of `tracked` (name -> tensor, updated in place by the optimizer) whose decay warms
    up as (1 + step) / (10 + step) to 0.999, and a progress line every `every` steps."""

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


def train(family, steps: int, batch: int, frames: int = 0, seed: int = 0) -> dict:
    """`family`'s model trained from its fresh init: each step a batch of digits, the class dropped 10 % of the
    time (classifier-free guidance), the family's objective; the averaged weights."""
    import torch

    torch.manual_seed(seed)
    run = family(seed=seed)  # a fresh init
    params, tracked, x0_of, labels = run.training(frames, seed)
    run.net.train()
    trainer = Trainer(params, tracked, steps, **run.optimizer(steps))
    for step in range(steps):
        idx = torch.randint(0, len(labels), (batch,))
        x0, y = x0_of(idx), labels[idx].clone()
        y[torch.rand(batch) < 0.1] = NULL_CLASS
        # ComfyUI's Flux blocks add into their inputs in place (inference code): autograd keeps a copy of what
        # they overwrite instead of failing.
        with torch.autograd.graph.allow_mutation_on_saved_tensors() if run.MUTATES else nullcontext():
            trainer.step(step, run.loss(x0, y))
    return run.finish(trainer.averaged(), steps, batch, frames, time.perf_counter() - trainer.start)


def trained_weights(args, family, config: dict) -> dict:
    """The weights at `args.weights`, trained first when asked (`--train`) or missing."""
    from safetensors.torch import load_file, save_file

    if args.train or not args.weights.exists():
        print(f"== training the digits {family.LABEL} ({args.train_steps} steps, batch {args.batch})", flush=True)
        start = time.perf_counter()
        weights = train(family, args.train_steps, args.batch, args.frames)
        args.weights.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(args.weights), metadata={"config": json.dumps(config),
                                                        "train_steps": str(args.train_steps), "batch": str(args.batch)})
        print(f"   wrote {args.weights} ({args.weights.stat().st_size / 2**20:.1f} MiB) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    return load_file(str(args.weights))


def one_channel_config(base, config: dict):
    """A ComfyUI model config of class `base` on `config` with a one-channel latent, fp32."""
    import torch
    from comfy import latent_formats

    class DigitsLatent(latent_formats.LatentFormat):
        latent_channels = 1

    class DigitsConfig(base):
        latent_format = DigitsLatent

    out = DigitsConfig(config)
    out.set_inference_dtype(torch.float32, None)
    return out


def own_weights(net, weights: dict, prefix: str = "diffusion_model.") -> None:
    net.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})


class UNet:
    """A ComfyUI UNetModel (EPS prediction on ComfyUI's default discrete schedule), the class as a cross-attention
    token; plain DDPM training."""
    LABEL, RESULT, FILE = "UNet", "deepcache_quality", "digits_unet.safetensors"
    DEFAULTS = dict(train_steps=2000, batch=64, steps=25, cfg=2.0, intervals=[1, 2, 3, 5])
    OPTIMIZER, MUTATES, CONTEXT_DIM, SCHEDULER = dict(lr=2e-3), False, 64, "normal"
    # Three levels (16, 8, 4 pixels; 32, 32, 64 channels), one ResBlock each, attention (self and cross, on the
    # class token) on the two lower levels and in the middle: the layout of SD1.5 at a toy scale (1.2 M parameters,
    # about 100 MFLOP per image), so DeepCache has six skip branches to choose from and training takes minutes.
    CONFIG = dict(
        image_size=SIZE, in_channels=1, out_channels=1, model_channels=32, num_res_blocks=[1, 1, 1],
        channel_mult=[1, 1, 2], use_spatial_transformer=True, transformer_depth=[0, 1, 1],
        transformer_depth_middle=1, transformer_depth_output=[0, 0, 1, 1, 1, 1], context_dim=CONTEXT_DIM,
        use_linear_in_transformer=True, legacy=False, adm_in_channels=None, use_checkpoint=False,
        use_temporal_attention=False, use_temporal_resblock=False,
    )

    def __init__(self, weights: dict | None = None, seed: int = 0):
        import torch
        from comfy import supported_models_base

        base = type("DigitsUNet", (supported_models_base.BASE,),
                    {"unet_extra_config": {"num_heads": 4, "num_head_channels": -1}})
        self.model = one_channel_config(base, dict(self.CONFIG)).get_model({}, device=torch.device("cpu"))
        self.net = self.model.diffusion_model
        self.tokens = torch.nn.Embedding(NULL_CLASS + 1, self.CONTEXT_DIM)
        if weights is None:
            # ComfyUI's layers skip weight init (they expect a checkpoint): use torch's default init instead.
            for module in self.net.modules():
                for kind in (torch.nn.Conv2d, torch.nn.Linear, torch.nn.GroupNorm, torch.nn.LayerNorm,
                             torch.nn.Embedding):
                    if isinstance(module, kind):
                        kind.reset_parameters(module)
                        break
            torch.nn.init.normal_(self.tokens.weight, std=1.0)
        else:
            own_weights(self.net, weights)
            self.tokens.weight.data.copy_(weights["class_tokens"])

    def training(self, frames: int, seed: int):
        images, labels, _, _ = digits()
        return ([*self.net.parameters(), self.tokens.weight],
                {**{f"diffusion_model.{k}": v for k, v in self.net.state_dict().items()},
                 "class_tokens": self.tokens.weight}, images.__getitem__, labels)

    def loss(self, x0, y):
        """eps prediction in ComfyUI's sigma parametrisation."""
        import torch

        sampling = self.model.model_sampling
        t = torch.randint(0, 1000, (len(y),))
        sigma = sampling.sigmas[t]
        noise = torch.randn_like(x0)
        x_in = sampling.calculate_input(sigma, x0 + noise * sigma.view(-1, 1, 1, 1))
        return torch.nn.functional.mse_loss(self.net(x_in, t.float(), context=self.tokens(y).unsqueeze(1)), noise)

    def optimizer(self, steps: int) -> dict:
        return self.OPTIMIZER

    def finish(self, weights: dict, *record) -> dict:
        return weights

    def conds(self, label: int, batch: int):
        return [[self.tokens.weight[label].detach().view(1, 1, -1), {}]]

    def generate(self, patcher, per_class: int, args):
        """`per_class` images of each digit through ComfyUI's sampler; digit d's seed is d in every setting."""
        import torch

        images = [sample(patcher, (self.conds(digit, per_class), self.conds(NULL_CLASS, per_class)),
                         (per_class, 1, SIZE, SIZE), args.steps, args.cfg, args.sampler, self.SCHEDULER,
                         seed=digit).out for digit in range(10)]
        return torch.cat(images).clamp(-1, 1)


class Flux(UNet):
    """ComfyUI's Flux class at 128 wide (flow matching on Flux's shifted schedule), the class as four context
    tokens and the pooled vector; rectified-flow training."""
    LABEL, RESULT, FILE = "Flux", "deepcache_dit_quality", "digits_flux.safetensors"
    DEFAULTS = dict(train_steps=1500, batch=48, steps=20, cfg=3.0, intervals=[2, 3, 5])
    OPTIMIZER, MUTATES, CONTEXT_DIM, CONTEXT_TOKENS, SCHEDULER = dict(lr=1e-3, clip=1.0), True, 32, 4, "simple"
    # Flux's layout at a toy scale: 4 heads of 32 (rope axes 8 + 12 + 12), patch 2 (64 image tokens), one latent
    # channel; no guidance embedding (the uncond side is the "no class" entry, as with cfg on a text model).
    CONFIG = dict(
        image_model="flux", in_channels=1, out_channels=1, vec_in_dim=CONTEXT_DIM, context_in_dim=CONTEXT_DIM,
        hidden_size=128, mlp_ratio=4.0, num_heads=4, depth=3, depth_single_blocks=3, axes_dim=[8, 12, 12],
        theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False,
    )

    def __init__(self, weights: dict | None = None, seed: int = 0):
        import torch
        from comfy import supported_models
        from tools.family_models import config_for_this_comfyui, fill_family

        config = one_channel_config(supported_models.Flux, config_for_this_comfyui(self.CONFIG))
        self.model = config.get_model({}, device=torch.device("cpu"))
        self.net = self.model.diffusion_model
        if weights is None:  # ComfyUI's layers skip init (they expect a checkpoint): like-init values, norms at one
            self.net.load_state_dict(fill_family(self.net, seed=0))
        else:
            own_weights(self.net, weights)
        self.tokens = torch.nn.Embedding(NULL_CLASS + 1, self.CONTEXT_TOKENS * self.CONTEXT_DIM)
        self.pooled = torch.nn.Embedding(NULL_CLASS + 1, self.CONTEXT_DIM)
        if weights is None:
            torch.nn.init.normal_(self.tokens.weight, std=1.0)
            torch.nn.init.normal_(self.pooled.weight, std=1.0)
        else:
            self.tokens.weight.data.copy_(weights["class_tokens"])
            self.pooled.weight.data.copy_(weights["class_pooled"])

    def training(self, frames: int, seed: int):
        params, tracked, x0_of, labels = super().training(frames, seed)
        return [*params, self.pooled.weight], {**tracked, "class_pooled": self.pooled.weight}, x0_of, labels

    def condition(self, labels):
        return self.tokens(labels).view(len(labels), self.CONTEXT_TOKENS, self.CONTEXT_DIM), self.pooled(labels)

    def loss(self, x0, y):
        """Rectified flow: x_t = t * noise + (1 - t) * x0, the model predicts noise - x0 (what ComfyUI's FLUX model
        type turns into a denoised image), t logit-normal."""
        import torch

        t = torch.sigmoid(torch.randn(len(y)))
        noise = torch.randn_like(x0)
        x_t = t.view(-1, 1, 1, 1) * noise + (1 - t.view(-1, 1, 1, 1)) * x0
        context, pooled = self.condition(y)
        velocity = self.net(x_t, self.model.model_sampling.timestep(t), context=context, y=pooled)
        return torch.nn.functional.mse_loss(velocity, noise - x0)

    def conds(self, label: int, batch: int):
        import torch

        context, pooled = self.condition(torch.full((batch,), label))
        return [[context.detach(), {"pooled_output": pooled.detach()}]]


class Wan(UNet):
    """ComfyUI's WanModel built as comfy.supported_models.WAN21_T2V, trained by flow matching on clips of the digits
    moving and turning over `--frames` frames, saved in ComfyUI's UNet layout and loaded by its UNETLoader. Wan's
    latent has 16 channels: FrameVAE maps a frame to them and back, so videos compare in pixel space. The class goes
    in as four context tokens of umT5's width, an eleventh "no class" entry for the uncond side."""
    LABEL, RESULT, FILE = "Wan 2.1", "deepcache_video_quality", "digits_wan21.safetensors"
    DEFAULTS = dict(train_steps=1400, batch=16, steps=24, cfg=5.0, intervals=[2, 3, 5], attention="pytorch")
    MUTATES, SCHEDULER = False, "simple"
    EXTRA = "accel_digits."  # the class tokens and training record: a prefix ComfyUI's UNet loader leaves out
    CANVAS, CHANNELS, CONTEXT_TOKENS, TEXT_DIM = 16, 16, 4, 4096  # canvas = latent positions; umT5's width
    # What detection reads back from the weights (comfy/model_detection.py: num_heads = dim // 128, the rest fixed
    # for Wan 2.1): one 128-wide head, 8 x 8 x 8 = 512 tokens for 8 frames at patch (1, 2, 2); 6 blocks, so that
    # DeepCache (first and last block live) skips 4 of 6 on a reused step.
    CONFIG = dict(
        image_model="wan2.1", model_type="t2v", dim=128, out_dim=CHANNELS, in_dim=CHANNELS, num_heads=1, ffn_dim=256,
        num_layers=6, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True,
        eps=1e-6,
    )

    def __init__(self, weights: dict | None = None, seed: int = 0, patcher=None):
        """A fresh model (like-init weights, tools/family_models.fill_family), or the tokens of `weights` beside
        the model ComfyUI's UNETLoader made of them (`patcher`)."""
        import torch
        from comfy import supported_models
        from tools.family_models import fill_family

        if patcher is None:
            config = supported_models.WAN21_T2V(dict(self.CONFIG))
            config.set_inference_dtype(torch.float32, None)
            self.model = config.get_model({}, device=torch.device("cpu"))
            self.model.diffusion_model.load_state_dict(fill_family(self.model.diffusion_model, seed=0))
        else:
            self.model = patcher.model
            self.tokens = weights[self.EXTRA + "class_tokens"].view(NULL_CLASS + 1, self.CONTEXT_TOKENS,
                                                                      self.TEXT_DIM)
        self.net, self.vae = self.model.diffusion_model, FrameVAE(self.model.latent_format)

    def training(self, frames: int, seed: int):
        import torch
        from tools.family_models import PREFIX

        generator = torch.Generator().manual_seed(seed)
        _, labels, features, _ = digits()
        ink = torch.tensor(features, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        self.embedding = torch.nn.Embedding(NULL_CLASS + 1, self.CONTEXT_TOKENS * self.TEXT_DIM)
        torch.nn.init.normal_(self.embedding.weight, std=1.0)

        def x0_of(idx):
            return self.model.latent_format.process_in(self.vae.encode(make_clips(ink[idx], frames, generator)))

        return ([*self.net.parameters(), self.embedding.weight],
                {**{PREFIX + k: v for k, v in self.net.state_dict().items()},
                 self.EXTRA + "class_tokens": self.embedding.weight}, x0_of, labels)

    def optimizer(self, steps: int) -> dict:
        return dict(lr=1e-3, clip=1.0, pct_start=max(0.05, 2 / steps), every=50)  # short runs: 2 warm-up steps

    def loss(self, x0, y):
        """Rectified flow in the model's space (x0 = process_in(VAE latent), what ComfyUI's sampler works in), the
        model predicting noise - x0 (ComfyUI's FLOW model type), t uniform through Wan's shifted schedule (shift
        8, as the "simple" scheduler steps it)."""
        import torch

        sampling = self.model.model_sampling
        t = sampling.sigma(torch.rand(len(y)) * sampling.multiplier)
        noise = torch.randn_like(x0)
        x_t = t.view(-1, 1, 1, 1, 1) * noise + (1 - t.view(-1, 1, 1, 1, 1)) * x0
        context = self.embedding(y).view(len(y), self.CONTEXT_TOKENS, self.TEXT_DIM)
        return torch.nn.functional.mse_loss(self.net(x_t, sampling.timestep(t), context=context), noise - x0)

    def finish(self, weights: dict, steps: int, batch: int, frames: int, seconds: float) -> dict:
        import torch
        from tools.family_models import PREFIX, Family, check_detection

        check_detection(Family("digits-wan21", "WAN21_T2V", self.CONFIG),  # UNETLoader will read it as WAN21_T2V
                        {k[len(PREFIX):]: v for k, v in weights.items() if k.startswith(PREFIX)})
        weights[self.EXTRA + "training"] = torch.tensor([steps, batch, frames, seconds], dtype=torch.float64)
        return weights

    def conds(self, label: int, batch: int):
        return [[self.tokens[label].view(1, self.CONTEXT_TOKENS, self.TEXT_DIM), {}]]

    def generate(self, patcher, clips_per_digit: int, args):
        """`clips_per_digit` clips of each digit (digit d's seed is d in every setting), decoded: (clips, frames,
        H, W) in [0, 1]."""
        import torch

        return torch.cat([self.vae.decode(sample(patcher, (self.conds(digit, 1), self.conds(NULL_CLASS, 1)),
                                                 (clips_per_digit, self.CHANNELS, args.frames, self.CANVAS,
                                                  self.CANVAS), args.steps, args.cfg, args.sampler, "simple",
                                                 seed=digit).out) for digit in range(10)])


class FrameVAE:
    """A fixed stand-in for Wan's VAE: latent = mean + 4 * std * u * frame (u a seeded unit vector over the 16
    channels; mean and std Wan 2.1's latent format's, as the real VAE's latents have them, so process_in hands
    the model 4 * u * frame, unit scale); decode is the map's pseudo-inverse, frames back in [0, 1]."""

    def __init__(self, latent_format, seed: int = 0):
        import torch

        u = torch.randn(Wan.CHANNELS, generator=torch.Generator().manual_seed(seed))
        self.mean = latent_format.latents_mean.view(1, Wan.CHANNELS, 1, 1, 1).float()
        self.weight = (4.0 * latent_format.latents_std.view(Wan.CHANNELS) * u / u.norm()).float()

    def encode(self, frames):  # (B, T, H, W) in [-1, 1] -> (B, 16, T, H, W)
        return self.mean + self.weight.view(1, Wan.CHANNELS, 1, 1, 1) * frames.unsqueeze(1)

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

    b, canvas = len(ink), Wan.CANVAS
    rand = functools.partial(torch.rand, generator=generator)
    reach = (canvas - 8) / 2  # how far (px) the digit's centre may move from the canvas centre
    heading = rand(b) * 2 * math.pi
    velocity = (0.5 + 0.75 * rand(b))[:, None] * torch.stack([heading.cos(), heading.sin()], 1)
    t = torch.arange(frames, dtype=torch.float32)
    position = (rand(b, 2) * 2 - 1)[:, None] * reach + velocity[:, None] * t[None, :, None]  # (B, T, 2)
    position = reach - ((position + reach) % (4 * reach) - 2 * reach).abs()  # reflected at +-reach: bouncing
    angle = (rand(b, 1) * 2 - 1) * math.radians(20) + (rand(b, 1) * 2 - 1) * math.radians(15) * t  # (B, T)
    cos, sin = angle.cos(), angle.sin()
    rotation = torch.stack([torch.stack([cos, sin], -1), torch.stack([-sin, cos], -1)], -2)  # R(-angle)
    shift = position.unsqueeze(-1) / (canvas / 2)  # normalised coordinates
    theta = torch.cat([rotation, -(rotation @ shift)], -1).flatten(0, 1)  # output point q <- R(-a) (q - c)
    grid = F.affine_grid(theta, [b * frames, 1, canvas, canvas], align_corners=False)
    padded = F.pad(ink, [(canvas - 8) // 2] * 4).repeat_interleave(frames, 0)
    return F.grid_sample(padded, grid, align_corners=False).view(b, frames, canvas, canvas) * 2 - 1
