"""DeepCache's speed through ComfyUI's sampler: the full-size SD1.5 UNet at intervals 2, 3 and 5 against no cache,
beside the registry package DeepCache on diffusers (bench/requirements.txt); `--family flux` the benchmark Flux
beside core EasyCache, each alone and with Compile Model. What each measures: bench/README.md.

    .venv/bin/python bench/deepcache_speed.py [--repeats 3] [--attention pytorch] [--steps 4 --repeats 1]
    .venv/bin/python bench/deepcache_speed.py --family flux [--steps 20] [--latent 16] [--repeats 3]
    python bench/deepcache_speed.py --family wan [--compile also] [--steps 24] [--frames 33] [--width 832] [--height 480]

`--family wan` is for a GPU: the video settings of bench/deepcache_quality.py --model wan on a Wan of Wan 2.1 T2V
1.3B's size (random weights, tools/make_models.py --set video, written when missing) at a real clip's latent, for
the speed those settings give where a model call is almost all blocks (the trained model's quality is in
docs/benchmarks/video.md; random weights say nothing of quality).
"""
from __future__ import annotations

import json
import statistics
import types

import _path  # noqa: F401  (the project root on sys.path)
from tools.comfy_env import comfyui_version, import_comfyui, load_pack
from tools.family_models import FLUX_BENCH, WAN_BENCH
from tools.harness import cli
from tools.harness.machine import cpu_model
from tools.harness.results import markdown_table, results_path, write_report
from tools.harness.sampling import BlockWork, conditioning, run_settings, sample, timed
from tools.harness.variants import rel_error

SD15_DIFFUSERS = dict(  # diffusers' names for the SD1.5 UNet configuration (tools/make_models.py SD15_FULL)
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8,
)


def comfy_side(args, pack) -> dict:
    import comfy.samplers
    import nodes
    import torch

    (unet,) = nodes.UNETLoader().load_unet(args.model, "default")
    gen = torch.Generator().manual_seed(0)
    conds = [[torch.randn(1, 77, 768, generator=gen), {}]], [[torch.randn(1, 77, 768, generator=gen), {}]]
    models = {1: unet}
    for n in args.intervals:
        (models[n],) = pack.nodes.deepcache.DeepCache().apply(unet, n, args.depth, 0.0, 1.0, "uniform")
    sample(unet, conds, (1, 4, args.latent, args.latent), 2, args.cfg)  # load the model, warm the allocator
    sigmas = comfy.samplers.calculate_sigmas(unet.get_model_object("model_sampling"), "normal", args.steps).tolist()
    flop_share = {}

    def run(n: int) -> tuple[float, list[float]]:
        sampled = sample(models[n], conds, (1, 4, args.latent, args.latent), args.steps, args.cfg)
        if n > 1:
            flop_share["last"] = pack.accel.telemetry.snapshot()["events"][-1].get("shallow_share")
        return sampled.seconds, sampled.step_s

    plans = {n: pack.accel.deepcache.schedule.make_plan(sigmas, n, "uniform", 1e9, 0.0) for n in models}
    out = rotations(list(models), args.repeats, run, lambda n, step: plans[n].full[step], "comfyui ")
    return out | {"shallow_share_flops": flop_share.get("last")}


def rotations(intervals: list[int], repeats: int, run, is_full, label: str) -> dict:
    """`repeats` rotations over the intervals (each rotation starting one further), `run(n)` -> (seconds, each
    step's seconds); each step's time counted as full compute or shallow by `is_full(n, step)`; summed up."""
    totals, full_steps, shallow_steps = {n: [] for n in intervals}, [], []
    for r in range(repeats):
        k = r % len(intervals)
        for n in intervals[k:] + intervals[:k]:
            total, steps = run(n)
            totals[n].append(total)
            for i, seconds in enumerate(steps[1:], start=1):  # step 0 is full and also starts the run: left out
                (full_steps if is_full(n, i) else shallow_steps).append(seconds)
            print(f"  {label} interval {n}: {total:7.2f} s", flush=True)
    return summarize(totals, full_steps, shallow_steps)


def summarize(totals: dict, full_steps: list, shallow_steps: list) -> dict:
    base = statistics.median(totals[1])
    share = statistics.median(shallow_steps) / statistics.median(full_steps) if shallow_steps and full_steps else None
    rows = {}
    for n, runs in totals.items():
        median = statistics.median(runs)
        rows[n] = {"seconds": median, "runs": runs, "speedup": base / median,
                   "limit": n / (1 + (n - 1) * share) if share is not None else None}
    return {"intervals": rows, "shallow_share_timed": share, "shallow_share_flops": None,
            "median_full_step_s": statistics.median(full_steps) if full_steps else None,
            "median_shallow_step_s": statistics.median(shallow_steps) if shallow_steps else None}


def reference_side(args) -> dict | None:
    """The registry package DeepCache on a diffusers UNet of the same configuration, or None when missing."""
    try:
        import diffusers
        from DeepCache import DeepCacheSDHelper
    except ImportError as exc:
        print(f"  reference skipped: {exc}. Install bench/requirements.txt into a separate environment "
              "(not the project's .venv) to compare with the registry package DeepCache.", flush=True)
        return None
    import torch

    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**SD15_DIFFUSERS).eval()
    scheduler = diffusers.EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                                 num_train_timesteps=1000)
    context = torch.randn(2, 77, 768, generator=torch.Generator().manual_seed(0))
    pipe = types.SimpleNamespace(unet=unet, scheduler=scheduler)  # all DeepCacheSDHelper reads from a pipeline

    def run(steps=args.steps):
        def loop(callback):
            scheduler.set_timesteps(steps)
            latents = torch.randn(1, 4, args.latent, args.latent, generator=torch.Generator().manual_seed(0))
            latents = latents * scheduler.init_noise_sigma
            with torch.inference_mode():
                for t in scheduler.timesteps:
                    model_in = scheduler.scale_model_input(torch.cat([latents] * 2), t)
                    uncond, cond = unet(model_in, t, encoder_hidden_states=context).sample.chunk(2)
                    latents = scheduler.step(uncond + args.cfg * (cond - uncond), t, latents).prev_sample
                    callback()
        return loop

    def with_helper(n):
        def loop(callback):
            helper = DeepCacheSDHelper(pipe=pipe)
            helper.set_params(cache_interval=n, cache_branch_id=args.depth)
            helper.enable()
            try:
                run()(callback)
            finally:
                helper.disable()
        return loop

    timed(run(2))
    return rotations([1, *args.intervals], args.repeats, lambda n: timed(run() if n == 1 else with_helper(n)),
                     lambda n, i: i % n == 0,  # the helper's uniform rule
                     f"DeepCache (diffusers {diffusers.__version__})") | {"diffusers": diffusers.__version__}


def sample_flux(model, latent: int, steps: int):
    """(output, seconds): the benchmark Flux's sampling at cfg 1, euler, the "simple" scheduler."""
    run = sample(model, conditioning(4096, pooled=True), (1, 16, latent, latent), steps, 1.0, scheduler="simple")
    return run.out, run.seconds


AUTO_PATTERN = "DeepCache interval 4, first only, forecast linear (the trained Flux's auto pattern)"


def flux_side(args, pack) -> None:
    """--family flux: every setting, alone and with Compile Model, warmed up once, then timed in rounds."""
    import nodes
    import torch
    from comfy_extras.nodes_easycache import EasyCacheNode

    from comfy_extras.nodes_easycache import LazyCacheNode

    deepcache = pack.nodes.deepcache.DeepCache()
    caches = {
        "full compute": lambda m: m,
        "EasyCache (defaults)": lambda m: EasyCacheNode.execute(m, 0.2, 0.15, 0.95, False).result[0],
        "LazyCache (defaults)": lambda m: LazyCacheNode.execute(m, 0.2, 0.15, 0.95, False).result[0],
        "DeepCache adaptive 0.2": lambda m: deepcache.apply(m, 3, 0, 0.0, 1.0, "adaptive")[0],
        "DeepCache interval 3": lambda m: deepcache.apply(m, 3, 0, 0.0, 1.0, "uniform")[0],
        "DeepCache auto (the default)": lambda m: deepcache.apply(m, 3, 0, 0.0, 1.0, "auto")[0],
        # The default's reuse pattern on the trained digits Flux (deepcache_front.md: 57.3 % of its blocks' compute
        # skipped, 15 of 20 steps reused, every block after the first): on random weights the adaptive signal
        # decides otherwise, so the same count of reused steps is set by hand, for the speed it gives at this width.
        AUTO_PATTERN: lambda m: deepcache.apply(m, 4, 0, 0.0, 1.0, "uniform", forecast="linear",
                                                live_blocks="first only")[0],
    }
    unknown = sorted(set(args.only or ()) - set(caches))
    if unknown:
        raise SystemExit(f"--only: no setting named {unknown}; the settings: {list(caches)}")
    caches = {name: make for name, make in caches.items() if name == "full compute" or not args.only
              or name in args.only}
    (model,) = nodes.UNETLoader().load_unet(args.model, "default")
    compile_node = pack.nodes.compile_model.CompileModel()
    compiled = compile_node.apply(model, "default", "auto", "auto", "always compiled")[0]
    bases = [("eager", model)] + ([] if args.no_compile else [("Compile Model", compiled)])

    net = model.model.diffusion_model
    work = BlockWork(net.double_blocks, net.single_blocks)
    # warmed up once each (Compile Model: its compile), then rounds over every setting
    cases = [((base_name, name), None, None, cache(base)) for base_name, base in bases
             for name, cache in caches.items()]
    outputs, works, seconds, times = run_settings(cases, lambda m: sample_flux(m, args.latent, args.steps)[0],
                                                  work.take, rounds=args.repeats)
    work.close()
    reference, rows = outputs["eager", "full compute"], []
    for (base_name, name), *_ in cases:
        out = outputs[base_name, name]
        # hooks count calls of the modules, exact in the eager settings; compiled blocks skip the same calls (the
        # decision is plain Python outside compiled code)
        skipped = 1.0 - works["eager", name] / works["eager", "full compute"]
        rows.append({"base": base_name, "setting": name, "first_seconds": times[base_name, name][0],
                     "seconds": seconds[base_name, name], "runs": times[base_name, name][1:],
                     "speedup_vs_full_eager": seconds["eager", "full compute"] / seconds[base_name, name],
                     "speedup_vs_full_same_base": seconds[base_name, "full compute"] / seconds[base_name, name],
                     "error_vs_full_eager": rel_error(out, reference),
                     "block_compute_skipped": skipped, "speedup_limit": 1.0 / (1.0 - skipped)})

    print("", *markdown_table(
        ["base", "setting", f"median s ({args.steps} steps)", "speedup vs full, same base", "limit from blocks skipped",
         "speedup vs full eager", "error vs full eager"],
        [[r["base"], r["setting"], f"{r['seconds']:.2f}", f"{r['speedup_vs_full_same_base']:.2f}x",
          f"{r['speedup_limit']:.2f}x ({100 * r['block_compute_skipped']:.0f}% skipped)",
          f"{r['speedup_vs_full_eager']:.2f}x", f"{r['error_vs_full_eager']:.1e}"] for r in rows]), sep="\n")
    write_report("deepcache_flux_speed", {"model": args.model, "steps": args.steps, "latent": args.latent,
                                          "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
                                          "rows": rows})


def wan_settings(pack, args) -> dict:
    """name -> what makes the setting's model from the loaded one: bench/deepcache_quality.py's video settings
    (same names), and uniform interval 5 with the first block live, which reuses as many steps (19 of 24) as the
    trained model's adaptive 0.5 with the fitted forecast did, so its time is that setting's at this size."""
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    deepcache = pack.nodes.deepcache.DeepCache()
    out = {"full compute": lambda m: m}
    for n in args.intervals:
        out[f"DeepCache interval {n}"] = lambda m, n=n: deepcache.apply(m, n, args.depth, 0.0, 1.0, "uniform")[0]
    out["DeepCache interval 5, first only"] = lambda m: deepcache.apply(
        m, 5, args.depth, 0.0, 1.0, "uniform", live_blocks="first only")[0]
    out["DeepCache adaptive 0.2 (default)"] = lambda m: deepcache.apply(m, 3, args.depth, 0.0, 1.0, "adaptive")[0]
    out["DeepCache adaptive 0.5, first only, fitted forecast"] = lambda m: deepcache.apply(
        m, 6, args.depth, 0.0, 1.0, "adaptive", 0.5, forecast="fitted", live_blocks="first only")[0]
    out["EasyCache 0.2 (default)"] = lambda m: EasyCacheNode.execute(m, 0.2, 0.15, 0.95, False).result[0]
    out["LazyCache 0.2 (default)"] = lambda m: LazyCacheNode.execute(m, 0.2, 0.15, 0.95, False).result[0]
    return out


# With --compile, these settings again on Compile Model ("always compiled": its compile in the warm-up generation)
WAN_COMPILED = ("full compute", "DeepCache interval 5, first only",
                "DeepCache adaptive 0.5, first only, fitted forecast", "EasyCache 0.2 (default)")


def wan_side(args, pack) -> None:
    """--family wan: each setting warmed up once, then timed in rounds over all of them; the blocks' compute
    counted by hooks, the GPU's peak memory of each setting's last generation."""
    import nodes
    import torch
    from video_memory import latent_shape

    made = wan_settings(pack, args)
    unknown = sorted(set(args.only or ()) - set(made))
    if unknown:  # before the model loads (seconds for 2.8 GB)
        raise SystemExit(f"--only: no setting named {unknown}; the settings: {list(made)}")
    (model,) = nodes.UNETLoader().load_unet(args.model, "default")
    wanted = [name for name in made if name == "full compute" or not args.only or name in args.only]
    cases = [(("eager", name), None, None, made[name](model)) for name in wanted
             if args.compile != "only" or name == "full compute"]  # only: eager's full compute is the reference
    if args.compile != "off":
        compiled = pack.nodes.compile_model.CompileModel().apply(model, "default", "auto", "auto", "always compiled")[0]
        cases += [(("Compile Model", name), None, None, made[name](compiled)) for name in WAN_COMPILED
                  if name in wanted]
    shape = latent_shape(args.width, args.height, args.frames)
    conds = conditioning(4096, tokens=512)  # umT5's prompt, padded to Wan's 512 tokens as ComfyUI's tokenizer does
    cuda = torch.cuda.is_available()
    work = BlockWork(model.model.diffusion_model.blocks)

    def observe() -> tuple[float, float | None]:
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        return work.take(), peak

    print(f"== {args.model} ({sum(p.numel() for p in model.model.diffusion_model.parameters()) / 1e9:.2f} B "
          f"parameters, {model.model.get_dtype()}), latent {list(shape)}, {args.steps} steps, cfg {args.cfg}, "
          f"euler, simple, on {torch.cuda.get_device_name() if cuda else 'the CPU'}", flush=True)
    generate = lambda m: sample(m, conds, shape, args.steps, args.cfg, scheduler="simple").out  # noqa: E731
    outputs, observed, seconds, times = run_settings(cases, generate, observe, rounds=args.repeats)
    work.close()
    full_work = observed["eager", "full compute"][0]
    rows = []
    for (base, name), *_ in cases:
        skipped = 1.0 - observed[base, name][0] / full_work
        rows.append({"base": base, "setting": name, "first_seconds": times[base, name][0],
                     "seconds": seconds[base, name], "runs": times[base, name][1:],
                     "speedup": seconds["eager", "full compute"] / seconds[base, name],
                     "block_compute_skipped": skipped, "speedup_limit": 1.0 / (1.0 - skipped),
                     "peak_gpu_gib": observed[base, name][1],
                     "error_vs_full_eager": rel_error(outputs[base, name], outputs["eager", "full compute"])})
    print("", *markdown_table(
        ["base", "setting", f"median s ({args.repeats} rounds)", "speedup vs full eager", "limit from blocks skipped",
         "share of the limit", "peak GPU memory (GiB)", "first generation s"],
        [[r["base"], r["setting"], f"{r['seconds']:.2f}", f"{r['speedup']:.2f}x",
          f"{r['speedup_limit']:.2f}x ({100 * r['block_compute_skipped']:.1f}% skipped)",
          f"{100 * r['speedup'] / r['speedup_limit']:.0f}%",
          "-" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.1f}", f"{r['first_seconds']:.1f}"]
         for r in rows]), sep="\n")
    write_report("deepcache_wan_speed" + ("_compiled" if args.compile == "only" else ""), {
        "model": args.model, "dtype": str(model.model.get_dtype()), "latent": list(shape), "steps": args.steps,
        "cfg": args.cfg, "rounds": args.repeats, "device": torch.cuda.get_device_name() if cuda else cpu_model(),
        "torch_threads": torch.get_num_threads(), "rows": rows})


def wan_model_file(name: str) -> None:
    """Write the named model with tools/make_models.py when the models folder lacks it (a fresh GPU machine)."""
    import subprocess
    import sys

    import folder_paths

    if folder_paths.get_full_path("diffusion_models", name) is None:
        subprocess.run([sys.executable, f"{_path.ROOT}/tools/make_models.py", "--set", "video",
                        "--only", name], check=True)


def main() -> None:
    parser = cli.parser(__doc__, model=None, steps=None, latent=None)
    parser.add_argument("--family", choices=("sd15", "flux", "wan"), default="sd15",
                        help="the SD1.5 UNet, Flux, or a Wan of Wan 2.1 1.3B's size (video; for a GPU)")
    parser.add_argument("--cfg", type=float, default=None, help="default 7 (sd15, flux), 5 (wan)")
    parser.add_argument("--frames", type=int, default=33, help="wan: the clip's frames (pixels)")
    parser.add_argument("--width", type=int, default=832, help="wan: pixels")
    parser.add_argument("--height", type=int, default=480, help="wan: pixels")
    parser.add_argument("--only", nargs="+", help="flux, wan: these settings (by name) and full compute")
    parser.add_argument("--compile", choices=("off", "also", "only"), default="off",
                        help="wan: some settings on Compile Model too (only: those, and eager's full compute)")
    parser.add_argument("--depth", type=int, default=0, help="cache branch (0 = shallowest, DeepCache's branch 0)")
    parser.add_argument("--intervals", type=int, nargs="+", default=[2, 3, 5])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-reference", action="store_true", help="skip the diffusers + DeepCache side")
    parser.add_argument("--no-compile", action="store_true", help="flux: only the settings without Compile Model")
    parser.add_argument("--attention", choices=["comfyui-default", "pytorch"], default="comfyui-default",
                        help="ComfyUI's attention: its default for the device (sub-quadratic on the CPU), or "
                             "ComfyUI's own --use-pytorch-cross-attention (SDPA, what diffusers uses)")
    args = parser.parse_args()
    if args.family == "wan":
        import torch

        args.model, args.cfg = args.model or WAN_BENCH.file_name, 5.0 if args.cfg is None else args.cfg
        args.steps = args.steps or 24  # the video quality runs' steps
        import_comfyui(cpu=not torch.cuda.is_available())
        wan_model_file(args.model)
        return wan_side(args, load_pack())
    args.cfg, args.steps = 7.0 if args.cfg is None else args.cfg, args.steps or 20
    if args.family == "flux":
        args.model, args.latent = args.model or FLUX_BENCH.file_name, args.latent or 16
        import_comfyui(cpu=True)
        return flux_side(args, load_pack())
    args.model, args.latent = args.model or "accel-sd15-a.safetensors", args.latent or 32

    comfy = import_comfyui(cpu=True, use_pytorch_cross_attention=args.attention == "pytorch")
    pack = load_pack()
    import torch

    print(f"== ComfyUI {comfyui_version(comfy)} + ComfyUI-Accel DeepCache, {args.model}, {args.steps} steps, "
          f"{args.latent}x{args.latent} latent, cfg {args.cfg}, branch {args.depth}, "
          f"{torch.get_num_threads()} threads, attention {args.attention}", flush=True)
    result = {
        "benchmark": "deepcache_speed", "model": args.model, "steps": args.steps, "latent": args.latent,
        "cfg": args.cfg, "cfg_batch": 2, "sampler": "euler", "depth": args.depth, "repeats": args.repeats,
        "attention": args.attention,
        "machine": cpu_model(),
        "torch": torch.__version__, "comfyui": comfyui_version(comfy), "threads": torch.get_num_threads(),
        "accel": comfy_side(args, pack),
    }
    if not args.no_reference:
        print("== reference: registry package DeepCache on diffusers UNet2DConditionModel", flush=True)
        result["reference"] = reference_side(args)

    ref = (result.get("reference") or {}).get("intervals", {})
    print("", *markdown_table(
        ["interval", "ComfyUI-Accel s", "speedup", "limit N/(1+(N-1)s)", "DeepCache (diffusers) speedup"],
        [[n, f"{row['seconds']:.2f}", f"{row['speedup']:.2f}x", f"{row['limit']:.2f}x" if row["limit"] else "-",
          f"{ref[n]['speedup']:.2f}x" if n in ref else "-"] for n, row in result["accel"]["intervals"].items()]),
        sep="\n")
    accel = result["accel"]
    share = f"{accel['shallow_share_timed']:.3f}" if accel["shallow_share_timed"] is not None else "-"
    print(f"\nshallow share s: {share} timed (median shallow step / median full step), "
          f"{accel['shallow_share_flops']} FLOP estimate")
    out = results_path("deepcache_speed.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
