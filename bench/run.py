"""Run every benchmark in bench/ (each a script with a main()), one after another."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

BENCHMARKS = ["eager_baseline.py", "compile_model.py", "compile_flux.py", "compile_steady.py", "cold_start.py", "deepcache_speed.py",
              "deepcache_quality.py", "swap_weights.py"]

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    for name in sys.argv[1:] or BENCHMARKS:
        print(f"== {name}", flush=True)
        runpy.run_path(str(here / name), run_name="__main__")
