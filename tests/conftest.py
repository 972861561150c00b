"""Fixtures: a real ComfyUI imported in-process, the pack loaded by ComfyUI's own loader, and a real server.

ComfyUI is `$COMFYUI_DIR` when set, else the default 0.3.75 from `make setup`. Nothing here mocks
ComfyUI or torch.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
