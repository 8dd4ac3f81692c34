"""The one clock: wall seconds, optionally after the device has finished its queued work.

On a CPU every op is synchronous, so the clock is plain `perf_counter`. On CUDA, kernels run
asynchronously: a measurement that must include them (benchmarks, cost curves, policies that
compare draft and verify costs) synchronises first; `sync=False` skips that, for hot paths
that do not need exact per-phase times.
"""

from __future__ import annotations

import time

import torch


def now(device: torch.device | str | None = None, sync: bool = True) -> float:
    """perf_counter, after `device`'s queued work when `sync` (a no-op on CPUs)."""
    if sync and device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
