"""Timing: CUDA events on the GPU, ``perf_counter`` on the CPU; medians after warm-up.

On the GPU a timed window holds several back-to-back calls (as an async op runs in a real
program: the host enqueues the next call while the GPU runs this one), so the window measures
the GPU's time per call, not the host's time to get each call started. That host time is
measured apart (:func:`host_seconds`) and reported beside it: a call whose host time exceeds its
GPU time is host-bound at that batch size.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable

import torch

WINDOW_S = 0.004  # GPU seconds per timed window (back-to-back calls) at least, where possible
MAX_CALLS = 32  # calls per timed window at most


def window_seconds(fn: Callable[[], object], calls: int) -> float:
    """GPU seconds per call over ``calls`` back-to-back calls, bracketed by events."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def measure(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int = 10,
    warmup: int = 2,
    budget_s: float = 20.0,
) -> list[float]:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then up to ``repeats`` timed ones.

    Stops repeating once the timed calls have taken ``budget_s`` (at least one is timed). On a
    CUDA device ``fn`` only enqueues, and each timed value is one window of back-to-back calls
    (enough for ``WINDOW_S``, at most ``MAX_CALLS``) divided by its number of calls.
    """
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    calls = 1
    if cuda:
        torch.cuda.synchronize(device)
        one = window_seconds(fn, 1)
        calls = max(1, min(MAX_CALLS, math.ceil(WINDOW_S / max(one, 1e-9))))
    times: list[float] = []
    while len(times) < max(1, repeats) and (not times or sum(times) * calls < budget_s):
        if cuda:
            times.append(window_seconds(fn, calls))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def host_seconds(fn: Callable[[], object], device: torch.device, calls: int = 16) -> float:
    """Host seconds to enqueue one call of ``fn`` (median of ``calls``; the GPU is idle at the
    start of each, so this is the call's own overhead, not a wait for earlier work)."""
    cuda = device.type == "cuda"
    times = []
    for _ in range(calls):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize(device)
    return statistics.median(times)


def host_rounds_us(fn: Callable[[], object], calls: int, rounds: int,
                   after: Callable[[], object] | None = None) -> list[float]:
    """Host microseconds per call of ``fn``: the mean over ``calls`` back-to-back calls, once
    per round; ``after`` (e.g. a device sync) runs after each round, outside the timing."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter_ns() - t0) / calls / 1e3)
        if after is not None:
            after()
    return out


def median(times: list[float]) -> float:
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def progress(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
