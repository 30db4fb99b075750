"""Timing: CUDA events on the GPU, ``perf_counter`` on the CPU; medians after warm-up."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch


def measure(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int = 10,
    warmup: int = 2,
    budget_s: float = 20.0,
) -> list[float]:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then up to ``repeats`` timed ones.

    Stops repeating once the timed calls have taken ``budget_s`` (at least one is timed). On a
    CUDA device each call is bracketed by events on the current stream; ``fn`` only enqueues.
    """
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times: list[float] = []
    while len(times) < max(1, repeats) and (not times or sum(times) < budget_s):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def median(times: list[float]) -> float:
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def progress(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
