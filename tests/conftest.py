"""Fixtures: a real ComfyUI imported in-process, the pack loaded by ComfyUI's own loader, and a real server.

ComfyUI is `$COMFYUI_DIR` when set, else the default 0.3.75 from `make setup`. Nothing here mocks
ComfyUI or torch.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Two test processes share this machine's cores (pyproject's `-n 2`): most of the suite is single-threaded
# (Dynamo, inductor's code generation, the C compiler, imports), so two of them fill the cores, and torch's own
# threads stay one per process so the two never oversubscribe the cores. Every process a test starts (servers,
# probes, background children) inherits the setting, so outputs compared across processes were computed with
# the same thread count (a CPU kernel split over 2 threads may round differently than over 1). torch may be
# imported already (by a plugin), so its count is set too.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
# Appended, not prepended: ComfyUI's top-level `nodes` module must win over this pack's `nodes/` folder.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from tools.comfy_env import comfyui_version, import_comfyui, load_pack  # noqa: E402
from tools.comfy_server import ComfyServer  # noqa: E402


def pytest_report_header(config):
    from tools.comfy_env import comfyui_dir

    path = comfyui_dir()
    import torch

    return f"ComfyUI {comfyui_version(path)} at {path}; torch {torch.__version__}"


@pytest.fixture(scope="session")
def comfy_dir() -> Path:
    """ComfyUI's core imported in this process (CPU), as its main.py would."""
    return import_comfyui(cpu=True)


@pytest.fixture(scope="session")
def comfy_nodes(comfy_dir):
    """ComfyUI's own node classes (UNETLoader, LoraLoader, KSampler, ...)."""
    import nodes

    return nodes


@pytest.fixture(scope="session")
def accel_pack(comfy_dir):
    """The pack as ComfyUI loads it from custom_nodes (its module, with `accel` and `nodes` below it)."""
    return load_pack()


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory):
    """A started ComfyUI server (main.py --cpu) with this pack in its custom_nodes; stopped even on failure."""
    with ComfyServer(tmp_path_factory.mktemp("comfy-server")) as server:
        yield server
