"""Imported first by each bench script (run as `python bench/NAME.py`, with bench/ on sys.path): puts the project
root on sys.path too, for tools/ (the harness, ComfyUI's import) and the pack."""
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.append(ROOT)
