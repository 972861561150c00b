"""Core EasyCache and LazyCache on the trained digits models, explained by their own per-step quantities.

For every model call: what the node decided (skipped or computed), the accumulated change it compared against its
threshold, and whether the step lay inside its start/end percent; beside them, what the same rule measures on full
compute (its k factor from the previous step against the change that then came), and PSNR against full compute.

    python bench/cache_rules_explained.py [--model wan] [--easycache 0.2 0.06] [--steps 50]

The node's state is read from its own holder (`transformer_options["easycache"]`, the per-run clone its
OUTER_SAMPLE wrapper makes) by wrappers of this script registered before the node's, so they run outside its
wrappers and see every call, the skipped ones included. Nothing of ComfyUI is patched. "copied input": the same
node, but this script's outer DIFFUSION_MODEL wrapper hands it a copy of the model input (what a model whose dtype
differs from the latent's gets anyway, `xc.to(dtype)` in BaseModel._apply_model), see the write-up:
docs/benchmarks/cache_rules_explained.md.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from deepcache_quality import MODELS, frame_psnr, psnr
from tools import digits_models as digits
from tools.digits_models import ASSETS, trained_weights

from tools.comfy_env import import_comfyui, load_pack
from tools.harness import cli
from tools.harness.results import markdown_table, write_report

KEY = "cache_rules_explained"
SUBSAMPLE = 8  # the nodes' subsample_factor


def arguments():
    parser = cli.parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="wan")
    parser.add_argument("--weights", type=Path, help="the trained model's file")
    parser.add_argument("--steps", type=int, help="sampling steps (the model's default in deepcache_quality.py)")
    parser.add_argument("--cfg", type=float)
    parser.add_argument("--sampler", default="euler")
    parser.add_argument("--per-class", type=int, default=10, help="unet, flux: images per digit")
    parser.add_argument("--frames", type=int, default=8, help="wan: latent frames per clip")
    parser.add_argument("--clips-per-digit", type=int, default=2, help="wan: clips per digit")
    parser.add_argument("--easycache", type=float, nargs="*", default=[0.2, 0.06],
                        help="EasyCache thresholds (0.2: the node's default; 0.06: the authors' Wan script)")
    parser.add_argument("--lazycache", type=float, nargs="*", default=[0.2], help="LazyCache thresholds")
    parser.add_argument("--copied", type=float, nargs="*", default=[0.2, 0.06],
                        help="EasyCache thresholds run again with the model input copied before the node")
    parser.add_argument("--start", type=float, default=0.15, help="start_percent (the nodes' default)")
    parser.add_argument("--end", type=float, default=0.95, help="end_percent (the nodes' default)")
    parser.add_argument("--shown", type=int, default=0, help="the sampling call (digit) whose steps are tabled")
    parser.add_argument("--json", type=Path, help="also write every call's record here")
    args = parser.parse_args()
    family = MODELS[args.model]
    for name, default in {"weights": ASSETS / family.FILE, **family.DEFAULTS}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    return args, family


def value(v):
    import torch

    return None if v is None else float(v.item() if isinstance(v, torch.Tensor) else v)


class Recorder:
    """Wrappers that record each model call of a sampling: runs[r] is the r-th sampling call's list of records."""

    def __init__(self, copy_input: bool = False):
        self.copy_input, self.runs, self.apply_x = copy_input, [], None

    def install(self, patcher):
        """A clone of `patcher` with this recorder's wrappers; a cache node applied to it afterwards adds its
        wrappers after these, so these run outside the node's."""
        import comfy.patcher_extension as pe

        out = patcher.clone()
        out.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, KEY, self.outer_sample)
        out.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, KEY, self.apply_model)
        out.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY, self.diffusion_model)
        out.add_wrapper_with_key(pe.WrappersMP.PREDICT_NOISE, KEY, self.predict_noise)
        return out

    def outer_sample(self, executor, *args, **kwargs):
        self.runs.append([])
        self.sigmas = [float(s) for s in args[3]]
        return executor(*args, **kwargs)

    def step_of(self, sigma: float) -> int:
        return min(range(len(self.sigmas)), key=lambda i: abs(self.sigmas[i] - sigma))

    def apply_model(self, executor, *args, **kwargs):
        self.apply_x = args[0]  # BaseModel._apply_model's x: calculate_denoised(sigma, output, x) reads it
        return executor(*args, **kwargs)

    def diffusion_model(self, executor, *args, **kwargs):
        options = args[-1] if isinstance(args[-1], dict) else kwargs.get("transformer_options", args[-2])
        holder = options.get("easycache")
        if holder is not None and holder.name != "EasyCache":
            return executor(*args, **kwargs)  # LazyCache: recorded at predict_noise
        x = args[0]
        uuids, sigma = options["uuids"], float(options["sigmas"][0])
        aliased = self.apply_x is not None and x.data_ptr() == self.apply_x.data_ptr()
        if self.copy_input:
            args = (x.clone(), *args[1:])
        before = snapshot(holder) if holder is not None else None
        first = uuids.index(holder.first_cond_uuid) if holder is not None and holder.first_cond_uuid in uuids else 0
        x_in = args[0][:, :(holder.output_channels if holder is not None else x.shape[1])].clone()
        out = executor(*args, **kwargs)
        record = {"step": self.step_of(sigma), "sigma": sigma, "conds": len(uuids), "first_cond": first,
                  "input_aliased": aliased}
        if holder is not None:
            record |= decided(holder, before, x_in, uuids, sigma)
            record["output_is_x"] = self.apply_x is not None and out.data_ptr() == self.apply_x.data_ptr()
        record |= measured(self.runs[-1], "diffusion_model", x_in, out, len(uuids), first)
        self.runs[-1].append(record)
        return out

    def predict_noise(self, executor, *args, **kwargs):
        x, sigma, options = args[0], float(args[1][0]), args[2]
        holder = options["transformer_options"].get("easycache")
        if holder is None or holder.name != "LazyCache":
            return executor(*args, **kwargs)
        before = snapshot(holder)
        x_in = x[:, :holder.output_channels].clone()
        out = executor(*args, **kwargs)
        record = {"step": self.step_of(sigma), "sigma": sigma, "conds": 1, "first_cond": 0}
        record |= decided(holder, before, x_in, None, sigma)
        record |= measured(self.runs[-1], "predict_noise", x_in, out, 1, 0)
        self.runs[-1].append(record)
        return out


def snapshot(holder) -> dict:
    return {"skipped": holder.total_steps_skipped, "cumulative": value(holder.cumulative_change_rate),
            "k": value(holder.relative_transformation_rate), "norm": value(holder.output_prev_norm),
            "x_prev": holder.x_prev_subsampled, "skip_flag": getattr(holder, "skip_current_step", False)}


def decided(holder, before: dict, x, uuids, sigma: float) -> dict:
    """What the node decided at this call and the quantity it compared (inside its start/end percent only, where
    it compares), from its holder before and after."""
    skipped = holder.total_steps_skipped > before["skipped"] or (
        uuids is not None and before["skip_flag"] and holder.first_cond_uuid not in uuids)
    out = {"skipped": bool(skipped), "threshold": holder.reuse_threshold, "start_sigma": value(holder.start_t),
           "end_sigma": value(holder.end_t), "k_before": before["k"], "cumulative_before": before["cumulative"],
           "cumulative_after": value(holder.cumulative_change_rate), "compared": None}
    out["inside"] = sigma <= out["start_sigma"] and sigma > out["end_sigma"]
    if out["inside"] and before["k"] is not None and before["norm"] is not None and before["x_prev"] is not None:
        current = holder.subsample(x, uuids, clone=False) if uuids is not None else holder.subsample(x, clone=False)
        if current.shape == before["x_prev"].shape:
            change = (current - before["x_prev"]).flatten().abs().mean().item()
            out["compared"] = before["cumulative"] + before["k"] * change / before["norm"]
    return out


def measured(records: list, where: str, x, out, conds: int, first: int) -> dict:
    """The rule's quantities on this call's first cond, whatever a node decided: input change, output change
    (relative to the previous output's mean |.|), k = output change / input change, and the change the previous
    call's k predicted; subsampled by 8 as the nodes do, and on every position."""

    x, out = x.float(), out.float()
    rows = x.shape[0] // conds
    part = slice(first * rows, (first + 1) * rows)
    now = {"x": x[part], "out": out[part][:, :x.shape[1]].clone()}
    result = {}
    previous = next((r for r in reversed(records) if r.get("_where") == where), None)
    result["_where"], result["_now"] = where, now
    if previous is None:
        return result
    p = previous.pop("_now")  # only the latest call's tensors are kept
    for name, sub in (("sub", lambda t: t[..., ::SUBSAMPLE, ::SUBSAMPLE]), ("all", lambda t: t)):
        d_in = (sub(now["x"]) - sub(p["x"])).abs().mean().item()
        d_out = (sub(now["out"]) - sub(p["out"])).abs().mean().item()
        norm = p["out"].abs().mean().item()
        result[f"in_{name}"], result[f"out_rate_{name}"] = d_in, d_out / norm
        result[f"k_{name}"] = d_out / d_in if d_in > 0 else None
        k_prev = previous.get(f"k_{name}")
        result[f"pred_rate_{name}"] = None if k_prev is None else k_prev * d_in / norm
    return result


def settings(patcher, args):
    """(name, recorder, patched model) for every setting, full compute first."""
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    out = []
    recorder = Recorder()
    out.append(("full compute", recorder, recorder.install(patcher)))
    for node, name, thresholds, copy in ((EasyCacheNode, "EasyCache", args.easycache, False),
                                         (LazyCacheNode, "LazyCache", args.lazycache, False),
                                         (EasyCacheNode, "EasyCache", args.copied, True)):
        for threshold in thresholds:
            recorder = Recorder(copy_input=copy)
            model = node.execute(recorder.install(patcher), threshold, args.start, args.end, False).result[0]
            out.append((f"{name} {threshold:g}" + (", copied input" if copy else ""), recorder, model))
    return out


def quality(family, a, b) -> float:
    if family is digits.Wan:
        return frame_psnr(a, b).mean().item()
    return psnr(a, b)


def step_table(records: list[dict], full: list[dict] | None) -> list[list]:
    """One row per step of one sampling call (its first cond's calls)."""
    rows = []
    for r in records:
        if r.get("first_cond") is None:
            continue
        inside = None
        if r.get("start_sigma") is not None:
            inside = r["sigma"] <= r["start_sigma"] and r["sigma"] > r["end_sigma"]
        f = next((g for g in full or [] if g["step"] == r["step"]), {})
        rows.append([r["step"], f"{r['sigma']:.3f}", "-" if inside is None else ("in" if inside else "out"),
                     "-" if "skipped" not in r else ("**skip**" if r["skipped"] else "compute"),
                     fmt(r.get("compared")), fmt(r.get("threshold"), 2),
                     fmt(f.get("out_rate_sub")), fmt(f.get("pred_rate_sub")), fmt(f.get("out_rate_all")),
                     fmt(f.get("k_sub")), fmt(f.get("k_all"))])
    return rows


def fmt(v, digits_: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits_}f}"


def main() -> None:
    args, family = arguments()
    import_comfyui(cpu=True, use_pytorch_cross_attention=family is digits.Wan)
    load_pack()
    import comfy.model_patcher
    import torch

    config = {**family.CONFIG, "frames": args.frames} if family is digits.Wan else family.CONFIG
    args.train, args.train_steps, args.batch = False, family.DEFAULTS["train_steps"], family.DEFAULTS["batch"]
    weights = trained_weights(args, family, config)
    if family is digits.Wan:  # ComfyUI's loader, as deepcache_quality.py loads it
        import folder_paths

        import nodes

        args.weights = args.weights.resolve()
        folder_paths.add_model_folder_path("diffusion_models", str(args.weights.parent), is_default=True)
        patcher = nodes.UNETLoader().load_unet(args.weights.name, "default")[0]
        run = family(weights, patcher=patcher)
        generate = lambda m: run.generate(m, args.clips_per_digit, args)
    else:
        run = family(weights)
        patcher = comfy.model_patcher.ModelPatcher(run.model, torch.device("cpu"), torch.device("cpu"))
        generate = lambda m: run.generate(m, args.per_class, args)
    dtype = next(patcher.model.diffusion_model.parameters()).dtype
    print(f"== {family.LABEL}: {args.steps} steps {args.sampler}, cfg {args.cfg:g}, model dtype {dtype}, "
          f"sampling type {type(patcher.model.model_sampling).__name__}", flush=True)
    cases = settings(patcher, args)
    outputs = {}
    for name, recorder, model in cases:
        outputs[name] = generate(model)
        print(f"  {name}: done", flush=True)
    full_name, full_rec = cases[0][0], cases[0][1]
    summary, report = [], {"model": args.model, "steps": args.steps, "cfg": args.cfg, "sampler": args.sampler,
                           "start_percent": args.start, "end_percent": args.end, "settings": {}}
    for name, recorder, _ in cases:
        calls = [r for run_ in recorder.runs for r in run_]
        decided_calls = [r for r in calls if "skipped" in r]
        per_run_skips = [sorted({r["step"] for r in run_ if r.get("skipped")}) for run_ in recorder.runs]
        steps_total = args.steps * len(recorder.runs)
        skipped = sum(len(s) for s in per_run_skips)
        p = quality(family, outputs[name], outputs[full_name])
        aliased = [r.get("input_aliased") for r in calls if "input_aliased" in r]
        wrote = [r.get("output_is_x") for r in decided_calls if r.get("skipped") and "output_is_x" in r]
        summary.append([name, f"{skipped}/{steps_total} ({100 * skipped / steps_total:.1f}%)",
                        "reference" if math.isinf(p) or p >= 100 else f"{p:.2f}",
                        "-" if not aliased else f"{sum(aliased)}/{len(aliased)}",
                        "-" if not wrote else f"{sum(wrote)}/{len(wrote)}",
                        " ".join(map(str, per_run_skips[args.shown])) or "none"])
        report["settings"][name] = {"psnr_vs_full": None if math.isinf(p) or p >= 100 else p, "steps_skipped": skipped,
                                    "steps_total": steps_total, "skipped_steps_per_call": per_run_skips,
                                    "records": [[{k: v for k, v in r.items() if not k.startswith("_")}
                                                 for r in run_] for run_ in recorder.runs]}
    print("", *markdown_table(["setting", "steps skipped (all calls)", "PSNR vs full (dB)",
                               "model input is _apply_model's x (calls)", "skipped calls whose output is that x",
                               f"skipped steps, call {args.shown}"], summary), sep="\n")
    full_run = [r for r in full_rec.runs[args.shown] if r.get("first_cond") is not None]
    for name, recorder, _ in cases[1:]:
        print(f"\n### {name}: call {args.shown} (digit {args.shown}), first cond's calls\n")
        print(*markdown_table(["step", "sigma", "window", "node decided", "compared (accumulated)", "threshold",
                               "full: out rate (sub 8)", "full: predicted by previous k (sub 8)",
                               "full: out rate (all)", "full: k (sub 8)", "full: k (all)"],
                              step_table(recorder.runs[args.shown], full_run)), sep="\n")
    print(f"\n### full compute: the rule's own quantities, call {args.shown}\n")
    print(*markdown_table(["step", "sigma", "in change (sub 8)", "out rate (sub 8)", "k (sub 8)",
                           "predicted rate (sub 8)", "out rate (all)", "k (all)", "predicted rate (all)"],
                          [[r["step"], f"{r['sigma']:.3f}", fmt(r.get("in_sub")), fmt(r.get("out_rate_sub")),
                            fmt(r.get("k_sub")), fmt(r.get("pred_rate_sub")), fmt(r.get("out_rate_all")),
                            fmt(r.get("k_all")), fmt(r.get("pred_rate_all"))] for r in full_run]), sep="\n")
    report = write_report(f"{KEY}_{args.model}_{args.steps}_{args.sampler}", report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
