"""Where benchmark results go: bench/results/<name>.json (ignored by git), with the machine and versions; and the
Markdown tables and PNG charts the benchmarks draw."""
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


def pyplot():
    """matplotlib's pyplot, drawing into files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_chart(fig, path) -> None:
    """`fig` laid out and written to `path` as a PNG (110 dpi), then closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
