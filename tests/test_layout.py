"""The code's layout as issue #71 asks it (docs/contributing.md, the layout): no class in accel/ over 200 lines, no
import circle among the modules of accel/, tools/ or bench/ (a circle is what makes a module's import order
matter and its parts impossible to move alone), bench/ never imports the tests (a benchmark measures the pack,
not the test helpers), and the engine never imports the child process's side, accel/compile/child/ (cut by
process: what runs only in a process of its own stays out of ComfyUI's).
Read from the source with `ast`: no torch, no ComfyUI.

Imports inside a function are left out of the circles: they run at call time, after every module is whole, which is
how the code breaks a circle on purpose (and says why where it does). Not out of the child's side: an import there
inside a function would still bring the child's code into ComfyUI's process."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("accel", "tools", "bench")


def module_names(folder: Path) -> dict[str, Path]:
    """Every module of the folder by its dotted name (a package by its own name, not `.__init__`)."""
    found = {}
    for path in folder.rglob("*.py"):
        parts = list(path.relative_to(folder.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_at_module_level(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that this module's top level imports (`from x import y` counts y when y is a module,
    else x)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            candidates = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                          for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known and "." in candidate:
                candidate = candidate.rpartition(".")[0]
            if candidate in known and candidate != name:
                targets.add(candidate)
    return targets


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("folder", PACKAGES)
def test_no_import_circle_at_module_level(folder):
    known = module_names(ROOT / folder)
    graph = {name: imported_at_module_level(name, path, known) for name, path in known.items()}
    found = circles(graph)
    assert not found, (f"modules of {folder}/ that import each other at module level: {found}; move what both "
                       f"need into a module of its own, or import inside the function that needs it (saying why)")


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_bench_never_imports_the_tests():
    tests = set(module_names(ROOT / "tests")) | {path.stem for path in (ROOT / "tests").glob("*.py")}
    offenders = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in tests]
    assert not offenders, f"bench/ imports test modules: {offenders}; move what it needs into tools/"


CHILD_PACKAGE = "accel.compile.child"
# What may import the child's side: the command line, which starts the child (`python -m accel compile-worker DIR`),
# and the precompile command, whose last step compiles and saves each kind as a child does, in its own process.
CHILD_IMPORTERS = {"accel/__main__.py", "accel/precompile.py"}


def child_imports(source: str, name: str, is_package: bool) -> list[str]:
    """Each import of CHILD_PACKAGE (or a module of it) in `source`, module `name` of the pack (relative to its
    root, "" for the root's __init__.py), at any depth: module level, in a function, in a class."""
    package = name if is_package else name.rpartition(".")[0]
    parts = package.split(".") if package else []
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                base = parts[:max(len(parts) - node.level + 1, 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module, *(f"{module}.{alias.name}" if module else alias.name for alias in node.names)]
        else:
            continue
        # absolute names also as the pack is imported inside ComfyUI (custom_nodes.<folder>.accel.compile.child)
        hits = {t for t in targets if f".{CHILD_PACKAGE}." in f".{t}."}
        if hits:  # once per import statement, by the shortest name it reaches
            found.append(f"line {node.lineno}: {min(hits, key=len)}")
    return found


def test_the_child_import_finder_finds_an_import_in_a_function():
    inside = "def f():\n    from ..child.serve import serve\n"
    assert child_imports(inside, "accel.compile.background.parent", False) == ["line 2: accel.compile.child.serve"]
    assert child_imports("from . import child\n", "accel.compile", True) == ["line 1: accel.compile.child"]
    assert child_imports("import custom_nodes.pack.accel.compile.child.saving\n", "nodes.x", False)
    assert child_imports("from .background import worker\nfrom ..cache import store\nfrom . import children\n",
                         "accel.compile.dispatch", False) == []


def test_the_engine_never_imports_the_child_side():
    """accel/ (but the child package itself and the two commands of CHILD_IMPORTERS), nodes/ and the pack's
    __init__.py never import accel/compile/child/, not even inside a function: the child's side stays out of
    ComfyUI's process, and the engine never reaches down into what only a child runs."""
    child_folder = ROOT / "accel" / "compile" / "child"
    files = [ROOT / "__init__.py", *sorted((ROOT / "accel").rglob("*.py")), *sorted((ROOT / "nodes").rglob("*.py"))]
    offenders, scanned = [], 0
    for path in files:
        relative = path.relative_to(ROOT)
        if child_folder in path.parents or relative.as_posix() in CHILD_IMPORTERS:
            continue
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        scanned += 1
        offenders += [f"{relative}: {hit}" for hit in
                      child_imports(path.read_text(encoding="utf-8"), ".".join(parts), path.name == "__init__.py")]
    assert scanned > 50, f"only {scanned} files scanned"
    assert (child_folder / "__init__.py").is_file(), "the child's package moved: update CHILD_PACKAGE"
    assert not offenders, (f"the engine imports the child process's side: {offenders}; put what both sides need in "
                           f"the engine (the child imports it from there), never the other way")



MAX_CLASS_LINES = 200  # issue #71: one job per class; a class past this has grown a second job


def test_no_class_in_accel_is_over_200_lines():
    long = []
    for path in sorted((ROOT / "accel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, (f"classes over {MAX_CLASS_LINES} lines: {long}; give the second job a class of its own "
                      f"(as KindEntry's runners, dynamo_runner.py and precompiled_runner.py)")
