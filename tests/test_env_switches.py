"""The pack's environment variables have one list, SETTINGS in accel/env_settings.py: every ACCEL_ name in the pack's
code is in it and every entry is read somewhere, README.md's table is what tools/env_table.py renders from it, and
README.md stays short. Source files are read as text: no torch, no ComfyUI (accel/__init__.py imports nothing)."""
from __future__ import annotations

import re
from pathlib import Path

from accel.env_settings import KINDS, README, SETTINGS
from tools import env_table

ROOT = Path(__file__).resolve().parent.parent
FIX = "python -m tools.env_table --write"
README_MAX_LINES = 250
NAME = re.compile(r"(?<![A-Za-z0-9_])ACCEL_[A-Z0-9_]+")
REGISTRY = ROOT / "accel" / "env_settings.py"


def pack_sources() -> list[Path]:
    """What ComfyUI loads of the pack: __init__.py, nodes/ and accel/ (the registry itself left out)."""
    files = [ROOT / "__init__.py", *sorted((ROOT / "nodes").rglob("*.py")), *sorted((ROOT / "accel").rglob("*.py"))]
    return [path for path in files if path != REGISTRY]


def names_in_sources() -> dict[str, list[str]]:
    """Each ACCEL_ name in the pack's sources, with the files that name it. A name ending in _ is a prefix in prose
    (`ACCEL_DISABLE_*`, `ACCEL_DISABLE_<NAME>`), not a variable."""
    found: dict[str, list[str]] = {}
    for path in pack_sources():
        for name in sorted(set(NAME.findall(path.read_text(encoding="utf-8")))):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_name_in_the_code_is_in_the_registry_and_back():
    registered = [s.name for s in SETTINGS]
    assert len(registered) == len(set(registered)), "a name is in SETTINGS (accel/env_settings.py) twice"
    found = names_in_sources()
    variables = {name: files for name, files in found.items() if not name.endswith("_")}
    missing = {name: files for name, files in variables.items() if name not in registered}
    assert not missing, (f"read by the pack but not in SETTINGS in accel/env_settings.py: {missing}; add an entry "
                         f"for each (doc=README.md puts it in README.md's table), then run `{FIX}`")
    unread = [name for name in registered if name not in variables]
    assert not unread, (f"in SETTINGS (accel/env_settings.py) but named in none of the pack's sources: {unread}; "
                        f"remove those entries (or fix the name), then run `{FIX}`")
    prefixes = [name for name in found if name.endswith("_")]
    assert all(any(r.startswith(p) for r in registered) for p in prefixes), \
        f"a prefix {prefixes} in the pack's sources matches no name in SETTINGS (accel/env_settings.py)"


def test_each_entry_is_complete_and_documented_where_it_says():
    for s in SETTINGS:
        assert s.kind in KINDS and s.default and s.does.endswith("."), f"{s.name}: kind, default and one sentence"
        if s.kind == "switch":
            assert s.default in ("on", "off"), f"{s.name}: a switch's default is on or off"
        if s.doc and s.doc != README:
            page = ROOT / s.doc
            assert page.is_file() and s.name in page.read_text(encoding="utf-8"), (
                f"{s.name} says it is documented in {s.doc}, which does not name it: document it there, or give it "
                f"doc=README.md in accel/env_settings.py and run `{FIX}`")


def test_readme_table_is_rendered_from_the_registry():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    try:
        _, table, _ = env_table.between_markers(text)
    except ValueError as err:
        raise AssertionError(f"{err}; put the two marker lines in README.md's Troubleshooting section, then run "
                             f"`{FIX}`") from None
    assert table == env_table.render(), (f"README.md's table of environment variables is not what SETTINGS in "
                                         f"accel/env_settings.py renders: run `{FIX}`")
    shown = {s.name for s in SETTINGS if s.in_readme}
    assert shown and all(f"| `{name}` |" in table for name in shown)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: shorten its prose (docs/ holds the details; "
        f"a setting tuned in docs/ can leave README.md's table by its `doc` in accel/env_settings.py, then `{FIX}`)")
