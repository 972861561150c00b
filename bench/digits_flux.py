"""DeepCache on a transformer that has learned something, beside core ComfyUI's EasyCache and LazyCache: a small
class-conditional Flux (ComfyUI's own Flux class at 128 wide, 3 double + 3 single stream blocks, 2.5 M parameters)
trained by flow matching on scikit-learn's digits (8x8, upsampled to 16x16), sampled by ComfyUI's own sampler.

    python bench/deepcache_dit_quality.py           # evaluate (trains first when the weights file is missing)
    python bench/deepcache_dit_quality.py --train   # train again, overwrite bench/assets/digits_flux.safetensors

Every setting runs on the same model, seeds, sampler and steps, in this one process: full compute; DeepCache with
the uniform schedule at intervals 2, 3 and 5; DeepCache adaptive at three thresholds; core EasyCache and LazyCache
at their default threshold (0.2) and two others. Per setting it reports:
- wall time (median of --repeats generations of all the images) and the speedup against full compute;
- the share of the blocks' compute skipped: every block call counted (forward pre-hooks, which change nothing),
  weighted by the block's parameters, against full compute's; its limit on the speedup is 1 / (1 - share);
- mean PSNR against full compute at the same seeds (pixels in [0, 1]);
- the accuracy of a digit classifier (logistic regression on the data set's training split) on the images.
The class goes in as four context tokens and the pooled vector (an eleventh "no class" entry for the uncond side),
so sampling uses classifier-free guidance with cond and uncond batched, as a text-to-image Flux run does at cfg > 1.

Needs scikit-learn (bench/requirements.txt, in an environment of its own). Results:
bench/results/deepcache_dit_quality.json and, with --plot, a PNG of quality against speedup per method.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from tools.comfy_env import comfyui_version, import_comfyui, load_pack  # noqa: E402

WEIGHTS = ROOT / "bench" / "assets" / "digits_flux.safetensors"
SIZE = 16
CONTEXT_DIM = 32
CONTEXT_TOKENS = 4
NULL_CLASS = 10
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
    from deepcache_quality import Trainer, digits

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
    import comfy.sample
    import torch

    images, targets = [], []
    for digit in range(10):
        latent = torch.zeros(per_class, 1, SIZE, SIZE)
        noise = comfy.sample.prepare_noise(latent, digit)
        images.append(comfy.sample.sample(
            patcher, noise, steps, cfg, sampler, "simple", conditioning.conds(digit, per_class),
            conditioning.conds(NULL_CLASS, per_class), latent, disable_pbar=True, seed=digit))
        targets += [digit] * per_class
    return torch.cat(images).clamp(-1, 1), targets


class BlockWork:
    """Counts the samples each transformer block processes (forward pre-hooks: they read the batch size and
    change nothing), weighted by the block's parameters: the blocks' compute, in parameter-samples."""

    def __init__(self, net):
        self.total = 0.0
        self.handles = []
        for blocks in (net.double_blocks, net.single_blocks):
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


def settings(pack, patcher, args):
    """(name, method, knob, the patched model) for every setting, full compute first."""
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    deepcache = pack.nodes.deepcache.DeepCache()
    out = [("full compute", "full", None, patcher)]
    for n in args.intervals:
        out.append((f"DeepCache interval {n}", "DeepCache uniform", n,
                    deepcache.apply(patcher, n, args.depth, 0.0, 1.0, "uniform")[0]))
    for threshold in args.adaptive:
        out.append((f"DeepCache adaptive {threshold:g}", "DeepCache adaptive", threshold,
                    deepcache.apply(patcher, args.adaptive_interval, args.depth, 0.0, 1.0, "adaptive", threshold)[0]))
    for node, name in ((EasyCacheNode, "EasyCache"), (LazyCacheNode, "LazyCache")):
        for threshold in args.easycache:  # start and end percent at the nodes' defaults
            model = node.execute(patcher, threshold, 0.15, 0.95, False).result[0]
            out.append((f"{name} {threshold:g}", name, threshold, model))
    return out


def plot(path: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"DeepCache uniform": "o", "DeepCache adaptive": "s", "EasyCache": "^", "LazyCache": "v"}
    for method, marker in markers.items():
        points = [(r["speedup"], r["psnr_vs_full"], r["knob"]) for r in rows
                  if r["method"] == method and r["psnr_vs_full"] is not None]  # None: equal to full compute
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=method)
            for x, y, knob in points:
                ax.annotate(f"{knob:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("speedup against full compute (wall time, this CPU)")
    ax.set_ylabel("PSNR against full compute (dB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="train again even if the weights exist")
    parser.add_argument("--train-steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--weights", type=Path, default=WEIGHTS)
    parser.add_argument("--per-class", type=int, default=10, help="generated images per digit (10 digits)")
    parser.add_argument("--steps", type=int, default=20, help="sampling steps")
    parser.add_argument("--cfg", type=float, default=3.0)
    parser.add_argument("--sampler", default="euler")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per setting (median)")
    parser.add_argument("--depth", type=int, default=0, help="DeepCache's cache_depth")
    parser.add_argument("--intervals", type=int, nargs="+", default=[2, 3, 5])
    parser.add_argument("--adaptive", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--adaptive-interval", type=int, default=3, help="adaptive: cache_interval (reuse cap)")
    parser.add_argument("--easycache", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    parser.add_argument("--plot", type=Path, help="write the quality-against-speedup chart here (PNG)")
    parser.add_argument("--grid", type=Path, help="also save the images of a few settings as one PNG")
    args = parser.parse_args()
    try:
        import sklearn  # noqa: F401
    except ImportError:
        print("deepcache_dit_quality skipped: it needs scikit-learn. Install bench/requirements.txt into an "
              "environment of its own (not the project's .venv), see bench/README.md.")
        return

    comfy_dir = import_comfyui(cpu=True)
    pack = load_pack()
    import comfy.model_patcher
    import torch
    from deepcache_quality import digit_classifier, psnr, save_grid, to_features, trained_weights

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
    result = {"benchmark": "deepcache_dit_quality", "comfyui": comfyui_version(comfy_dir), "torch": torch.__version__,
              "model": {"class": "comfy.ldm.flux.model.Flux", "config": DIGITS_FLUX, "parameters": parameters},
              "images_per_setting": 10 * args.per_class, "steps": args.steps, "cfg": args.cfg,
              "sampler": args.sampler, "scheduler": "simple", "repeats": args.repeats, "depth": args.depth,
              "adaptive_interval": args.adaptive_interval, "classifier_accuracy_real": real_accuracy,
              "torch_threads": torch.get_num_threads(), "settings": rows}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "deepcache_dit_quality.json").write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(args.plot, [r for r in rows if r["method"] != "full"],
             f"digits Flux ({parameters / 1e6:.1f} M), {args.steps} steps euler, cfg {args.cfg:g}, "
             f"{10 * args.per_class} images; labels: interval or threshold")
        print(f"chart: {args.plot}")
    if args.grid:
        shown = [r["setting"] for r in rows if r["method"] == "full" or r["knob"] in (3, 0.2)]
        save_grid(args.grid, {name: generated[name] for name in shown})
        print(f"images: {args.grid} ({', '.join(shown)}, left to right)")


if __name__ == "__main__":
    main()
