"""The benchmark Flux on ComfyUI 0.33 with and without dynamic VRAM (comfy-aimdo), in one process per VRAM mode:
core eager, core's TorchCompileModel and Compile Model's defaults, each's first sampling, then interleaved rounds
of steady samplings (medians per step), peak VRAM per variant, each output against eager's (bench/gpu.py's
ComfyUI 0.33 step; issue 69 item 5).

    python bench/dynamic_vram.py --vram dynamic|disabled [--latent 128] [--steps 8] [--rounds 3]
    python bench/dynamic_vram.py --vram disabled --family sd3 --model accel-tiny-sd3.safetensors --latent 8  # a CPU

`--vram dynamic` sets dynamic VRAM up as ComfyUI 0.33's main.py does (comfy-aimdo's init before torch starts CUDA,
its devices after, ModelPatcherDynamic as the core patcher); where it cannot be had (a CPU, ComfyUI before 0.33,
no comfy-aimdo) the result says why and the variants run without it. `--vram disabled` is `--disable-dynamic-vram`.
On 0.33.0 the benchmark Flux runs no core block CUDA graphs: comfy/ldm/flux/model.py calls no
`comfy.model_prefetch.prefetch_queue_pop` (only LTX-AV, MiniMax and two text encoders do, and only the text
encoders capture graphs), so "eager with dynamic VRAM" is what a default NVIDIA install runs for Flux.
"""
from __future__ import annotations

import statistics
import time

import _path  # noqa: F401  (the project root on sys.path)

from tools.family_models import FLUX_BENCH
from tools.harness import cli
from tools.harness.child import print_result
from tools.harness.sampling import conditioning, sample, synced_clock
from tools.harness.variants import rel_error, variant_model, wait_for_background

VARIANTS = ("eager", "accel", "core")  # core last: its cold compile in this process waits for nothing else


def enable_dynamic_vram_before_torch() -> str | None:
    """main.py's first half: comfy-aimdo's control initialised before torch touches CUDA. None when done, else
    why dynamic VRAM cannot be had here."""
    import importlib.util

    if importlib.util.find_spec("comfy_aimdo") is None:
        return "comfy-aimdo is not installed (ComfyUI before 0.33, or its requirements missing)"
    from comfy.cli_args import args, enables_dynamic_vram

    if not enables_dynamic_vram():
        return "ComfyUI's flags turn it off"
    import comfy_aimdo.control

    headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
    try:
        comfy_aimdo.control.init(simple_vram_headroom=headroom, nvml_pressure=not args.disable_nvml_pressure)
    except TypeError:  # older comfy-aimdo protocols, as main.py tries them
        comfy_aimdo.control.init()
    return None


def enable_dynamic_vram_after_import() -> str | None:
    """main.py's second half: comfy-aimdo's devices, then ModelPatcherDynamic as ComfyUI's core patcher (this
    benchmark process stands in for main.py; the pack itself never sets it)."""
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy_aimdo.control
    from comfy.cli_args import args

    if not mm.is_nvidia():
        return f"not an NVIDIA GPU (ComfyUI's device: {mm.get_torch_device()})"
    devices = mm.get_all_torch_devices()
    if not comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * 1024 ** 3)) for d in devices):
        return "comfy-aimdo found no working device"
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return None


def set_up(vram: str) -> dict:
    """ComfyUI imported on the GPU (if any) in the VRAM mode asked for; what was had, and why not."""
    import sys

    import torch

    from tools.comfy_env import comfyui_dir, import_comfyui

    sys.path.insert(0, str(comfyui_dir()))  # ComfyUI's flags are read before its core imports (comfy_import.py)
    import comfy.options  # noqa: F401
    from comfy.cli_args import args

    gpu = torch.cuda.is_available()  # asks the driver only: CUDA's context is not made yet
    if vram == "disabled" and hasattr(args, "disable_dynamic_vram"):
        args.disable_dynamic_vram = True
    why_not = None
    if vram == "dynamic":
        why_not = "no CUDA GPU" if not gpu else enable_dynamic_vram_before_torch()
    import_comfyui(cpu=not gpu)
    if vram == "dynamic" and why_not is None:
        why_not = enable_dynamic_vram_after_import()
    return {"vram": vram, "dynamic_vram": vram == "dynamic" and why_not is None, "why_not": why_not, "gpu": gpu}


class DeviceMemory:
    """The GPU's used memory read after every step (torch's allocator does not see comfy-aimdo's weights): the
    highest seen since `reset`, with torch's own peak beside it."""

    def __init__(self):
        import torch

        self.gpu = torch.cuda.is_available()
        self.peak_used = 0

    def reset(self):
        import torch

        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
        self.peak_used = 0

    def read(self, *_):
        import torch

        if self.gpu:
            free, total = torch.cuda.mem_get_info()
            self.peak_used = max(self.peak_used, total - free)

    def peaks(self) -> dict:
        import torch

        if not self.gpu:
            return {}
        return {"peak_device_used_mib": self.peak_used / 2**20,
                "peak_torch_allocated_mib": torch.cuda.max_memory_allocated() / 2**20}


def main() -> None:
    parser = cli.parser(__doc__, model=FLUX_BENCH.file_name, steps=8, latent=128, rounds=3,
                        variants=",".join(VARIANTS))
    parser.add_argument("--vram", choices=("dynamic", "disabled"), required=True)
    parser.add_argument("--family", default="flux", help="tools/families.py's conditioning, latent and cfg for "
                                                         "--model (default: Flux's, for the benchmark Flux)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: use 2 or more (steady steps leave out each sampling's first)")
    result = set_up(args.vram)
    import comfy.model_patcher

    import nodes
    from tools.comfy_env import comfyui_version, load_pack

    (model,) = nodes.UNETLoader().load_unet(args.model, "default")
    result.update(comfyui=comfyui_version(), model=args.model, latent=args.latent, steps=args.steps,
                  rounds=args.rounds, patcher=type(model).__name__,
                  is_dynamic=bool(getattr(model, "is_dynamic", lambda: False)()),
                  dynamic_class=hasattr(comfy.model_patcher, "ModelPatcherDynamic"))
    pack = load_pack()
    memory = DeviceMemory()
    from tools.families import BY_FAMILY

    family = BY_FAMILY[args.family]
    conds = conditioning(4096, 77, pooled=True) if args.family == "flux" else family.conds(0)
    shape = (*family.latent_shape[:-2], args.latent, args.latent)
    result["family"] = args.family

    def run(variant_model_, steps=args.steps):
        return sample(variant_model_, conds, shape, steps, family.cfg)

    made, variants = {}, {}
    for name in args.variants.split(","):
        memory.reset()
        start = time.perf_counter()
        made[name], engine = variant_model(name, model, pack)
        first = run(made[name])
        entry = {"first_sampling_s": synced_clock() - start, "is_dynamic": bool(getattr(
            made[name], "is_dynamic", lambda: False)())}
        background = wait_for_background(engine)
        if background is not None:
            entry["child_wait_s"] = background["wait_after_first_sampling_s"]
            start = time.perf_counter()
            run(made[name])  # loads the child's graphs and settles auto mode's choices
            entry["loading_sampling_s"] = synced_clock() - start
        settle = run(made[name])  # auto mode's whole-call check needs a few calls
        memory.read()
        entry.update(memory.peaks())
        entry["first_out"], entry["out"] = first.out, settle.out
        if engine is not None:
            stats = engine.REGISTRY.stats()
            entry["paths"] = {k["kind"]: k["path"] for k in stats["kinds"]}
            entry["verdicts"] = [c["verdict"] for c in stats["whole_call_checks"].values()]
            entry["status"] = engine.status.model_status(made[name].model)["text"]
        variants[name] = entry
    times = {name: [] for name in made}
    for _ in range(args.rounds):  # interleaved: the machine's drift falls on every variant alike
        for name, m in made.items():
            times[name] += run(m).step_s[1:]
    outputs = {name: (entry.pop("first_out"), entry.pop("out")) for name, entry in variants.items()}
    for name, entry in variants.items():
        entry["steady_ms_per_step"] = statistics.median(times[name]) * 1e3
        if "eager" in outputs:  # the first sampling's output and a settled one, each against eager's
            entry["first_error_vs_eager"] = rel_error(outputs[name][0], outputs["eager"][0])
            entry["error_vs_eager"] = rel_error(outputs[name][1], outputs["eager"][1])
    result["variants"] = variants
    print_result(result)


if __name__ == "__main__":
    main()
