"""DeepCache's quality on models that have learned something, beside core ComfyUI's EasyCache and LazyCache: small
class-conditional models trained on scikit-learn's digits (tools/digits_models.py), sampled through ComfyUI's own sampler.
What each `--model` measures, and where its results go: bench/README.md.

    python bench/deepcache_quality.py [--model unet]   # evaluate (trains first when the weights file is missing)
    python bench/deepcache_quality.py --model flux --train   # train again and overwrite its weights file
"""
from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools import digits_models as digits
from tools.digits_models import ASSETS, SIZE, trained_weights
from tools.comfy_env import import_comfyui, load_pack
from tools.harness import cli
from tools.harness.results import markdown_table, pyplot, save_chart, write_report
from tools.harness.sampling import BlockWork, run_settings

MODELS = {"unet": digits.UNet, "flux": digits.Flux, "wan": digits.Wan}
FORECAST = "DeepCache adaptive, first only, forecast"
FITTED = "DeepCache adaptive, first only, fitted forecast"
# TaylorSeer's rule as its paper describes it (full compute every N steps, the steps between forecast from the
# cached features by finite differences, order 1 or 2), on DeepCache's machinery: the uniform schedule, live
# blocks "first only" (every block after the first reused), forecast "linear" (order 1) or "quadratic" (order 2)
TAYLOR = {1: "TaylorSeer-style order 1", 2: "TaylorSeer-style order 2"}
# First Block Cache's rule as diffusers' hooks and Comfy-WaveSpeed describe it: the first block always runs, the
# rest of the model's blocks are reused while the first block's residual (its output minus its input) changed by
# less than the threshold, relative L1, since the last full step, with no cap on reused steps in a row: DeepCache's
# adaptive schedule with signal "first block residual", live blocks "first only", cache_interval = the steps.
# (DeepCache keeps the run's first and last steps full, which First Block Cache does not ask for.) "+ forecast":
# the same, each reused step's residual forecast as the fitted forecast does (cache-dit pairs its block caches with
# TaylorSeer's forecasts).
AUTO = "DeepCache auto (the default)"
FBC = "First Block Cache-style"
FBC_FORECAST = "First Block Cache-style + fitted forecast"


def arguments():
    """The options of every model, each model's own defaults where they differ (its class's DEFAULTS)."""
    parser = cli.parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="unet")
    parser.add_argument("--train", action="store_true", help="train again even if the weights exist")
    parser.add_argument("--train-steps", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--weights", type=Path, help="the trained model's file")
    parser.add_argument("--steps", type=int, help="sampling steps")
    parser.add_argument("--cfg", type=float)
    parser.add_argument("--sampler", default="euler", help="ComfyUI sampler name (euler, uni_pc, ...)")
    parser.add_argument("--depth", type=int, default=0, help="DeepCache's cache_depth (branch)")
    parser.add_argument("--intervals", type=int, nargs="+")
    parser.add_argument("--per-class", type=int, default=10, help="unet, flux: generated images per digit")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="flux: timed generations per setting in a row (median); 0: --rounds instead")
    parser.add_argument("--rounds", type=int, default=3,
                        help="wan, and flux with --repeats 0: timed rounds over all settings, after one warm-up "
                             "generation of each (median)")
    parser.add_argument("--frames", type=int, default=8, help="wan: latent frames per clip (training and sampling)")
    parser.add_argument("--clips-per-digit", type=int, default=2, help="wan: generated clips per digit")
    parser.add_argument("--adaptive", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--adaptive-interval", type=int, default=3, help="adaptive: cache_interval (reuse cap)")
    parser.add_argument("--forecast", type=float, nargs="*", default=[0.1, 0.2, 0.3],
                        help="flux, wan: adaptive thresholds with live_blocks 'first only' and forecast 'linear'")
    parser.add_argument("--fitted", type=float, nargs="*", default=[0.3, 0.5],
                        help="flux, wan: adaptive thresholds with live_blocks 'first only' and forecast 'fitted'")
    parser.add_argument("--forecast-interval", type=int, default=6, help="those settings' cache_interval")
    parser.add_argument("--taylor", type=int, nargs="*", default=[],
                        help="flux, wan: TaylorSeer-style settings at these full-compute intervals, order 1 and 2")
    parser.add_argument("--fbc", type=float, nargs="*", default=[],
                        help="flux, wan: First Block Cache-style settings at these residual-change thresholds")
    parser.add_argument("--fbc-forecast", type=float, nargs="*", default=[],
                        help="flux, wan: the same with forecast 'fitted'")
    parser.add_argument("--easycache", type=float, nargs="+", default=[0.1, 0.2, 0.4],
                        help="EasyCache and LazyCache thresholds")
    parser.add_argument("--no-auto", dest="auto", action="store_false",
                        help="leave out the node's default (schedule auto) row")
    parser.add_argument("--front", action="store_true",
                        help="unet: every setting of the DiT models' table (adaptive, core caches, wall time), "
                             "not the intervals' quality alone")
    parser.add_argument("--attention", choices=["comfyui-default", "pytorch"],
                        help="ComfyUI's attention: SDPA (--use-pytorch-cross-attention) or its CPU default "
                             "(sub-quadratic); wan's default is pytorch")
    parser.add_argument("--plot", type=Path, help="flux, wan: the quality-against-speedup chart here (PNG)")
    parser.add_argument("--grid", type=Path, help="unet, flux: the generated images of the settings as one PNG")
    parser.add_argument("--strip", type=Path, help="wan: the first clip's frames in a few settings here (PNG)")
    args = parser.parse_args()
    family = MODELS[args.model]
    for name, default in {"attention": "comfyui-default", "weights": ASSETS / family.FILE, **family.DEFAULTS}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args, family


def psnr(a, b) -> float:
    """Mean PSNR over images, pixels mapped from [-1, 1] to [0, 1]."""
    mse = (((a - b) / 2.0) ** 2).flatten(1).mean(1)
    return float(sum(10 * math.log10(1.0 / m) if m > 0 else float("inf") for m in mse.tolist()) / len(mse))


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


def digit_classifier():
    """Logistic regression on the data set's training split, its accuracy on the held-out real digits, and
    accuracy(images): its accuracy on generated 16x16 images in [-1, 1] of the digits 0..9, `per_class` each, as
    8x8 features (0..16, like the data set)."""
    import torch
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    _, _, features, targets = digits.digits()
    x_train, x_test, y_train, y_test = train_test_split(features, targets, test_size=0.25, random_state=0)
    classifier = LogisticRegression(max_iter=5000).fit(x_train, y_train)

    def accuracy(images) -> float:
        wanted = [digit for digit in range(10) for _ in range(len(images) // 10)]
        found = classifier.predict(((torch.nn.functional.avg_pool2d(images, 2) + 1.0) * 8.0).flatten(1).numpy())
        return float((found == wanted).mean())

    return accuracy, classifier.score(x_test, y_test)


def settings(pack, patcher, args):
    """(name, method, knob, the patched model) for every setting, full compute first."""
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    deepcache = pack.nodes.deepcache.DeepCache()
    out = [("full compute", "full", None, patcher)]
    if getattr(args, "auto", True):  # the node's default: the preset of the model's kind (accel/deepcache/presets.py)
        out.append(("DeepCache auto (the default)", AUTO, None,
                    deepcache.apply(patcher, 3, args.depth, 0.0, 1.0, "auto")[0]))
    for n in args.intervals:
        out.append((f"DeepCache interval {n}", "DeepCache uniform", n,
                    deepcache.apply(patcher, n, args.depth, 0.0, 1.0, "uniform")[0]))
    for threshold in args.adaptive:
        out.append((f"DeepCache adaptive {threshold:g}", "DeepCache adaptive", threshold,
                    deepcache.apply(patcher, args.adaptive_interval, args.depth, 0.0, 1.0, "adaptive", threshold)[0]))
    for threshold in args.forecast:  # First Block Cache's split, each reused step's residual forecast linearly
        out.append((f"DeepCache adaptive {threshold:g}, first only, forecast", FORECAST, threshold,
                    deepcache.apply(patcher, args.forecast_interval, args.depth, 0.0, 1.0, "adaptive", threshold,
                                    forecast="linear", live_blocks="first only")[0]))
    for threshold in args.fitted:  # the same, forecast as far as the signal moved
        out.append((f"DeepCache adaptive {threshold:g}, first only, fitted forecast", FITTED, threshold,
                    deepcache.apply(patcher, args.forecast_interval, args.depth, 0.0, 1.0, "adaptive", threshold,
                                    forecast="fitted", live_blocks="first only")[0]))
    for n in getattr(args, "taylor", ()):  # TAYLOR: full compute every n steps, order 1 and 2 between them
        for order, forecast in ((1, "linear"), (2, "quadratic")):
            out.append((f"{TAYLOR[order]}, interval {n}", TAYLOR[order], n,
                        deepcache.apply(patcher, n, args.depth, 0.0, 1.0, "uniform", forecast=forecast,
                                        live_blocks="first only")[0]))
    for rows, kind, forecast in (("fbc", FBC, "off"), ("fbc_forecast", FBC_FORECAST, "fitted")):
        for threshold in getattr(args, rows, ()):
            out.append((f"{kind} {threshold:g}", kind, threshold,
                        deepcache.apply(patcher, args.steps, args.depth, 0.0, 1.0, "adaptive", threshold,
                                        forecast=forecast, live_blocks="first only",
                                        signal="first block residual")[0]))
    for node, name in ((EasyCacheNode, "EasyCache"), (LazyCacheNode, "LazyCache")):
        for threshold in args.easycache:  # start and end percent at the nodes' defaults
            model = node.execute(patcher, threshold, 0.15, 0.95, False).result[0]
            out.append((f"{name} {threshold:g}", name, threshold, model))
    return out


def with_speed(row: dict, seconds: float, full_seconds: float, work: float, full_work: float) -> dict:
    skipped = 1.0 - work / full_work
    return {**row, "seconds": seconds, "speedup": full_seconds / seconds, "block_compute_skipped": skipped,
            "speedup_limit": 1.0 / (1.0 - skipped) if skipped < 1 else None}


def db(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def evaluate_unet(args, pack, run, patcher):
    """For each of `args.intervals` (DeepCache, uniform schedule; 1 is full compute): PSNR against full compute at
    the same seeds and the digit classifier's accuracy. The result, and no chart."""
    accuracy, real_accuracy = digit_classifier()
    print(f"== classifier accuracy on held-out real digits: {real_accuracy:.3f}", flush=True)
    cases = [(n, "full" if n == 1 else "DeepCache uniform", n, patcher if n == 1 else
              pack.nodes.deepcache.DeepCache().apply(patcher, n, args.depth, 0.0, 1.0, "uniform")[0])
             for n in args.intervals]
    generated, events, seconds, _ = run_settings(  # DeepCache's report of the sampling: steps reused, compute
        cases, lambda m: run.generate(m, args.per_class, args),
        lambda: (pack.accel.telemetry.snapshot()["events"] or [{}])[-1], repeats=1)
    reference, rows = generated[args.intervals[0]], {}  # the first setting (interval 1) is full compute
    for n, images in generated.items():
        report = events[n] if n > 1 else {}
        rows[n] = {"psnr_vs_full": psnr(images, reference), "accuracy": accuracy(images), "seconds": seconds[n],
                   "reused_steps": report.get("reused_steps", 0), "compute_skipped": report.get("compute_skipped", 0.0)}
    print("", *markdown_table(
        ["interval", "PSNR vs full (dB)", "classifier accuracy", "steps reused", "UNet compute skipped (FLOPs)"],
        [[n, "reference" if math.isinf(r["psnr_vs_full"]) else f"{r['psnr_vs_full']:.2f}", f"{r['accuracy']:.3f}",
          f"{r['reused_steps']}/{args.steps}", f"{100 * (r['compute_skipped'] or 0):.0f}%"] for n, r in rows.items()]),
        sep="\n")
    print(f"\nreal held-out digits: classifier accuracy {real_accuracy:.3f}; {10 * args.per_class} images per setting")
    if args.grid:
        save_grid(args.grid, generated)
        print(f"images: {args.grid} (intervals {', '.join(map(str, generated))}, left to right)")
    return {"images_per_setting": 10 * args.per_class, "steps": args.steps, "cfg": args.cfg, "sampler": args.sampler,
            "depth": args.depth, "classifier_accuracy_real": real_accuracy,
            "intervals": {n: {**row, "psnr_vs_full": None if math.isinf(row["psnr_vs_full"]) else row["psnr_vs_full"]}
                          for n, row in rows.items()}}, None


def evaluate_unet_front(args, pack, run, patcher):
    """`--front` on the UNet: every setting of `settings()` (uniform intervals, adaptive, DeepCache's auto, core
    EasyCache and LazyCache) with wall time (median of `--rounds` interleaved rounds after a warm-up), PSNR
    against full compute at the same seeds and the digit classifier's accuracy. The result, and no chart."""
    accuracy, real_accuracy = digit_classifier()
    print(f"== classifier accuracy on held-out real digits: {real_accuracy:.3f}", flush=True)
    args.intervals = [n for n in args.intervals if n > 1]  # settings() puts full compute first itself
    cases = settings(pack, patcher, args)
    generated, _, seconds, _ = run_settings(cases, lambda m: run.generate(m, args.per_class, args), lambda: None,
                                            rounds=args.rounds)
    full = cases[0][0]
    rows = [{"setting": name, "method": method, "knob": knob, "seconds": seconds[name],
             "speedup": seconds[full] / seconds[name], "psnr_vs_full": psnr(generated[name], generated[full]),
             "accuracy": accuracy(generated[name])} for name, method, knob, _ in cases]
    print("", *markdown_table(
        ["setting", "speedup (wall)", "PSNR vs full (dB)", "classifier accuracy"],
        [[r["setting"], f"{r['speedup']:.2f}x", "reference" if r["method"] == "full" else (
            "equal to full" if math.isinf(r["psnr_vs_full"]) else f"{r['psnr_vs_full']:.2f}"),
          f"{r['accuracy']:.3f}"] for r in rows]),
        sep="\n")
    for row in rows:
        row["psnr_vs_full"] = None if math.isinf(row["psnr_vs_full"]) else row["psnr_vs_full"]
    return {"images_per_setting": 10 * args.per_class, "steps": args.steps, "cfg": args.cfg, "sampler": args.sampler,
            "rounds": args.rounds, "classifier_accuracy_real": real_accuracy, "settings": rows}, None


def evaluate_flux(args, pack, run, patcher):
    """Every setting: wall time (median of `--repeats` generations of all the images in a row, or of `--rounds`
    interleaved rounds) and the speedup against
    full compute; the share of the blocks' compute skipped and its limit on the speedup, 1 / (1 - share); PSNR
    against full compute at the same seeds; the digit classifier's accuracy. The result, and the chart's title."""
    import torch

    parameters = sum(p.numel() for p in run.net.parameters())
    accuracy, real_accuracy = digit_classifier()
    print(f"== {parameters / 1e6:.2f} M parameters; classifier accuracy on held-out real digits: {real_accuracy:.3f}",
          flush=True)
    work, cases = BlockWork(run.net.double_blocks, run.net.single_blocks), settings(pack, patcher, args)
    generated, works, seconds, _ = run_settings(cases, lambda m: run.generate(m, args.per_class, args),
                                                work.take, repeats=args.repeats, rounds=args.rounds)
    work.close()
    full = cases[0][0]
    rows = [with_speed({"setting": name, "method": method, "knob": knob}, seconds[name], seconds[full], works[name],
                       works[full]) | {"psnr_vs_full": psnr(generated[name], generated[full]),
                                       "accuracy": accuracy(generated[name])} for name, method, knob, _ in cases]
    print("", *markdown_table(
        ["setting", "speedup (wall)", "block compute skipped", "its speedup limit", "PSNR vs full (dB)",
         "classifier accuracy"],
        [[r["setting"], f"{r['speedup']:.2f}x", f"{100 * r['block_compute_skipped']:.1f}%",
          f"{r['speedup_limit']:.2f}x",
          (("reference" if r["method"] == "full" else "equal to full") if math.isinf(r["psnr_vs_full"])
           else f"{r['psnr_vs_full']:.2f}"), f"{r['accuracy']:.3f}"] for r in rows]), sep="\n")
    print(f"\nreal held-out digits: classifier accuracy {real_accuracy:.3f}; {10 * args.per_class} images per setting")
    for row in rows:
        row["psnr_vs_full"] = None if math.isinf(row["psnr_vs_full"]) else row["psnr_vs_full"]
    if args.grid:
        shown = [r["setting"] for r in rows if r["method"] == "full" or r["knob"] in (3, 0.2)]
        save_grid(args.grid, {name: generated[name] for name in shown})
        print(f"images: {args.grid} ({', '.join(shown)}, left to right)")
    return ({"model": {"class": "comfy.ldm.flux.model.Flux", "config": run.CONFIG, "parameters": parameters},
             "images_per_setting": 10 * args.per_class, "steps": args.steps, "cfg": args.cfg,
             "sampler": args.sampler, "scheduler": "simple", "repeats": args.repeats,
             "rounds": args.rounds if not args.repeats else None, "depth": args.depth,
             "adaptive_interval": args.adaptive_interval, "classifier_accuracy_real": real_accuracy,
             "torch_threads": torch.get_num_threads(), "settings": rows},
            f"digits Flux ({parameters / 1e6:.1f} M), {args.steps} steps euler, cfg {args.cfg:g}, "
            f"{10 * args.per_class} images; labels: interval or threshold")


def evaluate_wan(args, pack, run, patcher, weights: dict):
    """Every setting against full compute at the same seeds (pixels in [0, 1]): PSNR and SSIM of every frame, mean
    and worst frame; the temporal error, PSNR of the frame-to-frame differences (a static error cancels, flicker
    does not); the blocks' compute skipped and the speedup it allows; wall time from `--rounds` interleaved rounds
    after one untimed generation of each. The result, and the chart's title."""
    import torch

    train_steps, train_batch, train_frames, train_seconds = weights[run.EXTRA + "training"].tolist()
    parameters = sum(p.numel() for p in run.net.parameters())
    clips = 10 * args.clips_per_digit
    print(f"== {args.weights.name}: {type(patcher.model).__name__}, {parameters / 1e6:.2f} M parameters "
          f"({next(run.net.parameters()).dtype}), trained {int(train_steps)} steps at batch {int(train_batch)} in "
          f"{train_seconds / 60:.1f} min; {clips} clips of {args.frames} frames, {args.steps} steps {args.sampler}, "
          f"cfg {args.cfg:g}, {torch.get_num_threads()} threads", flush=True)
    work, cases = BlockWork(run.net.blocks), settings(pack, patcher, args)  # Wan has one block list
    videos, works, seconds, times = run_settings(cases, lambda m: run.generate(m, args.clips_per_digit, args),
                                                 work.take, rounds=args.rounds)
    work.close()
    full = cases[0][0]
    rows = []
    for name, method, knob, _ in cases:
        video, reference = videos[name], videos[full]
        equal = bool(torch.equal(video, reference))
        frame, ssim = frame_psnr(video, reference), frame_ssim(video, reference)
        temporal = frame_psnr(video.diff(dim=1), reference.diff(dim=1))
        rows.append(with_speed({"setting": name, "method": method, "knob": knob}, seconds[name], seconds[full],
                               works[name], works[full]) | {
            "times": times[name][1:], "equal_to_full": equal, "psnr_vs_full": None if equal else frame.mean().item(),
            "psnr_worst_frame": None if equal else frame.min().item(), "ssim_vs_full": ssim.mean().item(),
            "ssim_worst_frame": ssim.min().item(), "temporal_psnr_vs_full": None if equal else temporal.mean().item()})
    table = []
    for r in rows:
        quality = ("reference" if r["method"] == "full" else "equal to full") if r["equal_to_full"] else None
        table.append([r["setting"], f"{r['speedup']:.2f}x", f"{100 * r['block_compute_skipped']:.1f}%",
                      f"{r['speedup_limit'] or 0:.2f}x", *([quality] * 5 if quality else [
                          db(r["psnr_vs_full"]), db(r["psnr_worst_frame"]), f"{r['ssim_vs_full']:.4f}",
                          f"{r['ssim_worst_frame']:.4f}", db(r["temporal_psnr_vs_full"])])])
    print("", *markdown_table(["setting", "speedup (wall)", "block compute skipped", "its speedup limit",
                               "PSNR vs full (dB)", "worst frame (dB)", "SSIM vs full", "worst frame",
                               "temporal PSNR (dB)"], table), sep="\n")
    print(f"\n{clips} clips x {args.frames} frames per setting; wall time: median of {args.rounds} interleaved "
          f"rounds, full compute {seconds[full]:.1f} s per generation")
    if args.strip:  # full compute, DeepCache (adaptive 0.2, its fast variants, interval 3) and EasyCache 0.2
        shown = [n for n in ("full compute", "DeepCache adaptive 0.2", "DeepCache adaptive 0.2, first only, forecast",
                             "DeepCache adaptive 0.5, first only, fitted forecast", "DeepCache interval 3",
                             "EasyCache 0.2") if n in videos]
        save_strip(args.strip, {n: videos[n][0] for n in shown})
        print(f"frames of the first clip (digit 0): {args.strip} ({', '.join(shown)}, top to bottom)")
    return ({"model": {"class": "comfy.ldm.wan.model.WanModel", "comfy_model": type(patcher.model).__name__,
                       "detected_as": "WAN21_T2V", "config": run.CONFIG, "parameters": parameters,
                       "file": args.weights.name, "context_tokens": run.CONTEXT_TOKENS,
                       "training": {"steps": int(train_steps), "batch": int(train_batch), "frames": int(train_frames),
                                    "seconds": train_seconds}},
             "clips_per_setting": clips, "frames": args.frames, "canvas": run.CANVAS, "steps": args.steps,
             "cfg": args.cfg, "sampler": args.sampler, "scheduler": "simple", "rounds": args.rounds,
             "depth": args.depth, "adaptive_interval": args.adaptive_interval,
             "forecast_interval": args.forecast_interval, "attention": args.attention,
             "torch_threads": torch.get_num_threads(), "settings": rows},
            f"digits Wan 2.1 video ({parameters / 1e6:.1f} M), {args.steps} steps {args.sampler}, cfg {args.cfg:g}, "
            f"{clips} clips x {args.frames} frames; labels: interval or threshold")


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


def save_strip(path: Path, videos: dict, scale: int = 4) -> None:
    """One row per setting (its name at the left), the clip's frames across, pixels `scale`x."""
    from PIL import Image, ImageDraw

    frames, height, width = next(iter(videos.values())).shape
    label, gap, line = 160, 2, 12
    strip = Image.new("L", (label + frames * (width * scale + gap), len(videos) * (height * scale + gap)), 255)
    draw = ImageDraw.Draw(strip)
    for row, (name, video) in enumerate(videos.items()):
        top = row * (height * scale + gap)
        lines = name.split(", ")  # a setting's parts one under the other: the label column is narrow
        draw.multiline_text((4, top + (height * scale - line * len(lines)) // 2), ",\n".join(lines), fill=0,
                            spacing=2)
        for t in range(frames):
            frame = Image.fromarray((video[t] * 255).round().byte().numpy()).resize((width * scale, height * scale),
                                                                                   Image.NEAREST)
            strip.paste(frame, (label + t * (width * scale + gap), top))
    strip.save(path)


def plot(path: Path, rows: list[dict], title: str) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    markers = {"DeepCache uniform": "o", "DeepCache adaptive": "s", FORECAST: "D", FITTED: "P", "EasyCache": "^",
               "LazyCache": "v", TAYLOR[1]: "<", TAYLOR[2]: ">", FBC: "X", FBC_FORECAST: "*", AUTO: "o"}
    for method, marker in markers.items():
        points = [(r["speedup"], r["psnr_vs_full"], r["knob"]) for r in rows
                  if r["method"] == method and r["psnr_vs_full"] is not None]  # None: equal to full compute
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=method)
            for x, y, knob in points:
                if knob is not None:  # the auto row has no knob of its own
                    ax.annotate(f"{knob:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("speedup against full compute (wall time, this CPU)")
    ax.set_ylabel("PSNR against full compute (dB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_chart(fig, path)


def main() -> None:
    args, family = arguments()
    if (args.train or not args.weights.exists() or family is not digits.Wan) and not importlib.util.find_spec(
            "sklearn"):  # training needs it, and the classifier; evaluating the Wan's committed file does not
        # a message, not an error: a run of several benchmarks goes on with the others
        print(f"{family.RESULT} skipped: it needs scikit-learn. Install bench/requirements.txt into an environment "
              "of its own (not the project's .venv), see bench/README.md.")
        return
    import_comfyui(cpu=True, use_pytorch_cross_attention=args.attention == "pytorch")
    pack = load_pack()
    import comfy.model_patcher
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    config = {**family.CONFIG, "frames": args.frames} if family is digits.Wan else family.CONFIG
    weights = trained_weights(args, family, config)
    if family is digits.Wan:  # through ComfyUI's detection and loader, from a folder added as extra_model_paths would
        import folder_paths
        import nodes

        args.weights = args.weights.resolve()
        folder_paths.add_model_folder_path("diffusion_models", str(args.weights.parent), is_default=True)
        patcher = nodes.UNETLoader().load_unet(args.weights.name, "default")[0]
        assert type(patcher.model).__name__ == "WAN21", type(patcher.model).__name__
        result, title = evaluate_wan(args, pack, family(weights, patcher=patcher), patcher, weights)
    else:
        run = family(weights)
        patcher = comfy.model_patcher.ModelPatcher(run.model, torch.device("cpu"), torch.device("cpu"))
        unet = evaluate_unet_front if args.front else evaluate_unet
        result, title = (unet if family is digits.UNet else evaluate_flux)(args, pack, run, patcher)
    write_report(family.RESULT, result)
    if args.plot and title:
        plot(args.plot, [r for r in result["settings"] if r["method"] != "full"], title)
        print(f"chart: {args.plot}")


if __name__ == "__main__":
    main()
