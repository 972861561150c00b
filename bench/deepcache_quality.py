"""DeepCache's quality on models that have learned something, beside core ComfyUI's EasyCache and LazyCache: small
class-conditional models trained on scikit-learn's digits, sampled through ComfyUI's own sampler.

    python bench/deepcache_quality.py [--model unet]   # evaluate (trains first when the weights file is missing)
    python bench/deepcache_quality.py --model flux --train   # train again and overwrite its weights file

`--model` picks the model (its module has the model, its training and what is measured on it):
- unet (bench/digits_unet.py, bench/assets/digits_unet.safetensors): a ComfyUI UNetModel (1.2 M parameters), DeepCache
  at intervals 1, 2, 3 and 5: PSNR against full compute and a digit classifier's accuracy. Results:
  bench/results/deepcache_quality.json.
- flux (bench/digits_flux.py, digits_flux.safetensors): ComfyUI's Flux class at 128 wide (2.6 M parameters); full
  compute, DeepCache uniform and adaptive, EasyCache and LazyCache at three settings each, in one process: wall-time
  speedup, the blocks' compute skipped and the speedup it allows, PSNR, classifier accuracy. Results:
  bench/results/deepcache_dit_quality.json.
- wan (bench/digits_wan.py, digits_wan21.safetensors): a Wan 2.1 video model (1.9 M parameters) on moving digits; the
  same settings: PSNR and SSIM of every frame and of the frame-to-frame differences, blocks' compute skipped,
  wall-time speedups from interleaved rounds. Results: bench/results/deepcache_video_quality.json.
`--plot` (flux, wan) draws quality against speedup per method; `--grid` (unet, flux) saves the images, `--strip`
(wan) a clip's frames. Needs scikit-learn to train and, for the classifier, to evaluate unet and flux
(bench/requirements.txt, in an environment of its own); without it the benchmark is skipped with a message.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from digits import plot
from tools.comfy_env import import_comfyui, load_pack
from tools.harness import cli
from tools.harness.results import write_report

MODELS = {"unet": "digits_unet", "flux": "digits_flux", "wan": "digits_wan"}


def arguments():
    """The options of every model, each model's own defaults where they differ (its module's DEFAULTS)."""
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
    parser.add_argument("--threads", type=int, default=0, help="unet: torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="flux: timed generations per setting (median)")
    parser.add_argument("--rounds", type=int, default=3, help="wan: timed rounds over all settings (median)")
    parser.add_argument("--frames", type=int, default=8, help="wan: latent frames per clip (training and sampling)")
    parser.add_argument("--clips-per-digit", type=int, default=2, help="wan: generated clips per digit")
    parser.add_argument("--adaptive", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--adaptive-interval", type=int, default=3, help="adaptive: cache_interval (reuse cap)")
    parser.add_argument("--easycache", type=float, nargs="+", default=[0.1, 0.2, 0.4],
                        help="EasyCache and LazyCache thresholds")
    parser.add_argument("--attention", choices=["comfyui-default", "pytorch"],
                        help="ComfyUI's attention: SDPA (--use-pytorch-cross-attention) or its CPU default "
                             "(sub-quadratic); wan's default is pytorch")
    parser.add_argument("--plot", type=Path, help="flux, wan: the quality-against-speedup chart here (PNG)")
    parser.add_argument("--grid", type=Path, help="unet, flux: the generated images of the settings as one PNG")
    parser.add_argument("--strip", type=Path, help="wan: the first clip's frames in a few settings here (PNG)")
    args = parser.parse_args()
    model = importlib.import_module(MODELS[args.model])
    for name, default in {"attention": "comfyui-default", **model.DEFAULTS}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args, model


def main() -> None:
    args, model = arguments()
    if getattr(model, "needs_sklearn", lambda args: True)(args) and importlib.util.find_spec("sklearn") is None:
        # a message, not an error: a run of several benchmarks goes on with the others
        print(f"{model.NAME} skipped: it needs scikit-learn. Install bench/requirements.txt into an environment of "
              "its own (not the project's .venv), see bench/README.md.")
        return
    import_comfyui(cpu=True, use_pytorch_cross_attention=args.attention == "pytorch")
    result, title = model.evaluate(args, load_pack())
    write_report(model.NAME, result)
    if args.plot and title:
        plot(args.plot, [r for r in result["settings"] if r["method"] != "full"], title)
        print(f"chart: {args.plot}")


if __name__ == "__main__":
    main()
