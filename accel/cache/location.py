"""Where the pack's compile cache lives, and the fingerprint of the environment its artifacts are valid for.

The cache belongs to the ComfyUI install (`<ComfyUI base directory>/accel_cache`), not to torch's default under
/tmp that a reboot or a fresh container empties. `ACCEL_CACHE_DIR` overrides it. Inside, every environment
(torch version, device, GPU, driver; on the CPU its model and vector instructions) gets a directory of its own, so
a torch, driver, GPU or CPU change misses cleanly instead of loading kernels built for something else.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

ENV_VAR = "ACCEL_CACHE_DIR"
DIR_NAME = "accel_cache"
# The vector instructions inductor's C++ kernels may be built for (torch's cpu_vec_isa picks among them), by their
# /proc/cpuinfo names (x86's flags, Arm's Features). Two CPUs of one model name (a VM's "AMD EPYC") may differ
# there, and a kernel built for one would stop a process on the other with an illegal instruction.
CPU_FEATURES = ("fma", "f16c", "avx2", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")


def cache_root() -> Path:
    """`$ACCEL_CACHE_DIR`, else `accel_cache` in ComfyUI's base directory, else in the user's cache directory."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    folder_paths = sys.modules.get("folder_paths")  # ComfyUI's; only when ComfyUI is the host
    base = getattr(folder_paths, "base_path", None)
    if base:
        return Path(base) / DIR_NAME
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "comfyui-accel"


def fingerprint(device_type: str) -> dict[str, str]:
    """What compiled artifacts depend on beyond their own keys: a change of any of these is a clean miss."""
    import torch

    found = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
             "device": device_type}
    if device_type == "cpu":
        found["cpu"] = _cpu_model()  # inductor's C++ kernels are built for this CPU's vector instructions
        found["cpu_features"] = _cpu_features()
    if device_type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device()
        found["gpu"] = torch.cuda.get_device_name(index)
        found["capability"] = "%d.%d" % torch.cuda.get_device_capability(index)
        found["cuda"] = str(torch.version.cuda)
        driver = getattr(torch._C, "_cuda_getDriverVersion", None)
        found["driver"] = str(driver()) if driver else "unknown"
    return found


def environment_id(found: dict[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:12]
    return f"{found['device']}-{digest}"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    present = set(line.split(":", 1)[1].split())
                    return " ".join(feature for feature in CPU_FEATURES if feature in present)
    except OSError:
        pass
    return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment_dirs(root: Path) -> list[Path]:
    """The pack's environment directories under `root`: each holds its fingerprint.json. Nothing else there is
    the pack's to count, evict or clear: ACCEL_CACHE_DIR may name a folder that holds other things too (a shared
    volume's root, ~/.cache)."""
    return sorted(p for p in root.iterdir() if (p / "fingerprint.json").is_file()) if root.is_dir() else []


def read_fingerprint(env_dir: Path) -> dict | None:
    """An environment's fingerprint.json; None when it cannot be read (missing, damaged). It only describes the
    environment (its folder's name is the id), so a damaged one costs nothing but its description: the next
    process to use the environment writes it again."""
    try:
        found = json.loads((env_dir / "fingerprint.json").read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
