"""Which host cores a benchmark's child processes run on: the lent hosts' cores differ in speed.

On a one-H200 host, a process pinned to one of 5 of its 16 cores ran a Python loop 1.5-1.9x
slower, and a loop of the CUDA primitives the hooks issue 1.4-1.8x slower, than pinned to any of
the other 11 (``bench.dev_core_speed``, bench/results/h200_eb9f4b0_session35/). An unpinned
process runs where the scheduler puts it, so on host-bound steps the same code measured 15-30%
apart from one process to the next, more than the differences the stock bench is there to judge.

:func:`fast_cores` times a short Python loop on each core this process may use (pinning its own
thread to each in turn, its affinity restored after) and returns those within ``slack`` of the
fastest. :func:`pinned` starts children on them: a process inherits its parent thread's affinity
at fork, and every thread it starts inherits it in turn, so the child's interpreter, its CUDA
driver threads and its ranks' (under ``torchrun``) all stay on the fast cores. Timed again before
every child: a core's speed can change while a bench runs.
"""

from __future__ import annotations

import contextlib
import os
import time

SLACK = 1.15  # a core within this factor of the fastest counts as fast


def _loop_s(rounds: int = 5, n: int = 4000) -> float:
    """Best of ``rounds`` of a small interpreter loop (about 0.3 ms on a fast core), seconds."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        acc = 0
        for i in range(n):
            acc += (i * i) % 7
        best = min(best, time.perf_counter() - t0)
    return best


def core_speeds(cores: list[int] | None = None) -> dict[int, float]:
    """Seconds of :func:`_loop_s` pinned to each of ``cores`` (default: every core this thread
    may use); this thread's affinity is restored after."""
    allowed = os.sched_getaffinity(0)
    cores = sorted(allowed) if cores is None else cores
    speeds = {}
    try:
        for c in cores:
            os.sched_setaffinity(0, {c})
            _loop_s(1)  # settle on the core (a migration, a cold cache)
            speeds[c] = _loop_s()
    finally:
        os.sched_setaffinity(0, allowed)
    return speeds


def fast_cores(slack: float = SLACK) -> tuple[list[int], dict[int, float]]:
    """``(cores within slack of the fastest, every core's loop seconds)``; all of them where
    this platform cannot pin (no ``sched_setaffinity``)."""
    if not hasattr(os, "sched_setaffinity"):
        return [], {}
    speeds = core_speeds()
    best = min(speeds.values())
    return sorted(c for c, s in speeds.items() if s <= slack * best), speeds


@contextlib.contextmanager
def pinned(cores: list[int] | None):
    """Within the block, this thread (and so any process started from it) runs on ``cores``
    only; None or empty: unchanged."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
