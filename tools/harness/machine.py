"""The machine and versions a benchmark ran on, as its result files and reports name them."""
from __future__ import annotations

import os
import platform
import subprocess


def versions() -> dict:
    """The machine (architecture, cores, GPU) and the versions of Python, torch and ComfyUI: what every result file
    and report carries, and what `bench/report.py --update` compares before keeping a report's tables."""
    import torch

    from tools.comfy_env import comfyui_version

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {gpu}", "python": platform.python_version(),
            "torch": torch.__version__, "comfyui": comfyui_version()}


def cpu_model() -> str:
    """The CPU by name (from /proc/cpuinfo) and its cores, as the CPU benchmarks' documents name the machine."""
    name = platform.processor() or ""
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.machine()} {name}, {os.cpu_count()} cores".strip()


def gpu_machine_lines() -> list[str]:
    """The GPU machine and its versions as docs/benchmarks/gpu.md's Setup lists them (bench/gpu.py)."""
    import torch

    from tools.comfy_env import comfyui_dir, comfyui_version

    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        gpu = subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        gpu = f"{torch.cuda.get_device_name()} (no nvidia-smi: driver unknown)"
    try:
        import triton
    except ImportError:
        triton = None
    return [f"- **Machine:** {gpu} (name, driver, memory); {os.cpu_count()} CPU cores "
            f"({len(os.sched_getaffinity(0))} usable), {platform.machine()}",
            f"- **Versions:** Python {platform.python_version()}, torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}), triton {getattr(triton, '__version__', 'not installed')}, ComfyUI "
            f"{comfyui_version()} ({comfyui_dir()})"]
