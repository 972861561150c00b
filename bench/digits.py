"""What the DeepCache quality benchmark's three digits models share (bench/deepcache_quality.py): scikit-learn's
digits data set and a classifier of it, the training loop's optimizer and averaging, PSNR and image grids, the
weights file (trained when missing), the settings compared (DeepCache, EasyCache, LazyCache), the blocks' compute
counted by hooks, and the chart of quality against speedup."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

SIZE = 16  # the 8x8 digits, upsampled
NULL_CLASS = 10  # the "no class" entry of classifier-free guidance


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
