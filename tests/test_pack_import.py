"""The pack loads in ComfyUI as ComfyUI loads it, registers its nodes, and changes nothing global."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("hygiene_probe.py")
EXPECTED_DISPLAY_NAMES = ["Compile Model", "Compile VAE", "DeepCache", "Swap Weights"]


def run_probe(mode: str) -> dict:
    proc = subprocess.run([sys.executable, str(PROBE), mode], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_nodes_registered_in_comfyui(accel_pack):
    import nodes

    names = accel_pack.NODE_CLASS_MAPPINGS
    for key, cls in names.items():
        assert nodes.NODE_CLASS_MAPPINGS[key] is cls
        assert cls.CATEGORY.startswith("Accel")
        assert nodes.NODE_DISPLAY_NAME_MAPPINGS[key] == accel_pack.NODE_DISPLAY_NAME_MAPPINGS[key]
        assert cls.RETURN_TYPES and hasattr(cls, cls.FUNCTION)
    display = list(accel_pack.NODE_DISPLAY_NAME_MAPPINGS.values())
    for wanted in EXPECTED_DISPLAY_NAMES:
        assert any(wanted in name for name in display), f"no node named like {wanted!r} in {display}"


def test_web_directory_registered(accel_pack):
    import nodes

    web_dirs = [Path(p).resolve() for p in nodes.EXTENSION_WEB_DIRS.values()]
    assert (Path(accel_pack.__file__).parent / "web").resolve() in web_dirs


def test_import_is_lazy_and_cheap():
    report = run_probe("lazy")
    assert report["newly_imported"] == [], f"importing the pack pulled in {report['newly_imported']}"
    assert report["import_seconds"] < 2.0, report


def test_import_changes_no_torch_transformers_or_comfyui_global():
    report = run_probe("globals")
    assert report["config_changes"] == [], f"torch config changed by the pack: {report['config_changes']}"
    assert report["attribute_changes"] == [], f"patched attributes: {report['attribute_changes']}"


def test_hygiene_probe_detects_a_patch(comfy_dir):
    """The globals probe must be able to fail: a deliberate monkeypatch in the same snapshot is reported."""
    sys.path.insert(0, str(PROBE.parent))
    try:
        import hygiene_probe
    finally:
        sys.path.remove(str(PROBE.parent))
    import torch

    before = hygiene_probe.attribute_snapshot()
    original = torch.nn.functional.silu
    torch.nn.functional.silu = lambda x, inplace=False: original(x)
    try:
        after = hygiene_probe.attribute_snapshot()
    finally:
        torch.nn.functional.silu = original
    assert "torch.nn.functional.silu" in hygiene_probe.diff(before, after)


@pytest.mark.parametrize("with_version", [True, False])
def test_comfy_node_validate(tmp_path, with_version):
    """`comfy node validate` (the Comfy Registry's check) passes on the pack and fails without a version."""
    root = Path(__file__).resolve().parent.parent
    pack = root
    if not with_version:  # a copy of the pack's metadata with the version removed
        pack = tmp_path / "pack"
        pack.mkdir()
        text = (root / "pyproject.toml").read_text()
        (pack / "pyproject.toml").write_text(text.replace('version = "0.1.0"\n', ""))
        (pack / "__init__.py").write_text((root / "__init__.py").read_text())
    comfy = Path(sys.executable).with_name("comfy")
    proc = subprocess.run([str(comfy), "--skip-prompt", "node", "validate"], cwd=pack, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert (proc.returncode == 0) == with_version, proc.stdout + proc.stderr


def engine_import_graph(root: Path) -> dict[str, set[str]]:
    """Which modules of the engine (accel/) import which others, from their source: every `from .x import y` and
    `from accel.x import y`, at module level or inside a function (a lazy import is still a dependency), except
    those only a type checker runs (`if TYPE_CHECKING:`)."""
    import ast

    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or id(node) in typing_only:
                continue
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == root.name:
                base = node.module
            else:
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles, as its strongly connected components of more than one module."""
    order, low, stack, found, counter = {}, {}, [], [], [0]

    def visit(node: str) -> None:
        order[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in order:
            visit(node)
    return found


def test_the_engine_has_no_import_circle():
    """A module that needs another only inside a function to dodge a circle still depends on it: every such pair
    is a design knot (who owns what). None in accel/, lazy imports included."""
    graph = engine_import_graph(Path(__file__).resolve().parent.parent / "accel")
    assert import_circles(graph) == []
    # the check can fail: a lazy import back into a module that imports this one is found
    graph["accel.compile.registry"].add("accel.compile.status")
    graph["accel.compile.status"].add("accel.compile.registry")
    assert any({"accel.compile.registry", "accel.compile.status"} <= set(c) for c in import_circles(graph))
