"""Clocks for the benchmarks: on a GPU, work is queued, so a time is read once the device has done it."""
from __future__ import annotations

import time


def synced_clock() -> float:
    """perf_counter once the GPU (if any) has finished what was queued: a step's time is its work's."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()
