"""pytest only (ComfyUI never imports this file).

The pack's root has an `__init__.py`, because ComfyUI imports the pack as a package. pytest therefore collects
the checkout as a Python package and imports that `__init__.py` under the checkout folder's name before the
first test, which fails when the name is not a valid module name (a clone named ComfyUI-Accel, a worktree
named wt-deepcache). The root is collected as a plain directory instead; the tests load the pack through
ComfyUI's own loader. A conftest's hooks only see paths below it, and the root itself is collected from its
parent, so the hook is registered as a plugin, which sees every path.
"""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


class _RootIsADirectory:
    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if path == ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    config.pluginmanager.register(_RootIsADirectory(), "accel-root-is-a-directory")
