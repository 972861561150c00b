"""Where benchmark results go: bench/results/<name>.json (ignored by git), with the machine and versions."""
from __future__ import annotations

import json
from pathlib import Path

from tools.comfy_env import ROOT

RESULTS = ROOT / "bench" / "results"


def results_path(name: str) -> Path:
    """bench/results/`name`, its folder made."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / name


def write_report(name: str, report: dict) -> dict:
    """Add the machine and versions to `report`, write it to bench/results/<name>.json, print its ratios if any."""
    from tools.harness.machine import versions

    report = {"benchmark": name, **report, **versions()}
    results_path(f"{name}.json").write_text(json.dumps(report, indent=2))
    if "ratios" in report:
        print(json.dumps(report["ratios"], indent=2))
    return report


def markdown_table(columns: list[str], rows) -> list[str]:
    """A Markdown table's lines: the columns' names, the separator, then a line per row (a list of cells)."""
    return ["| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|",
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]
