"""Dev probe (#21): one offload variant's steps one by one, to find what a slow step did.

``python3 -m bench.dev_step_modes --models tv-resnet50 --arm memory --steps 30`` (GPU; on the
CPU a smoke run on the tiny models). ResNet-50's compressed steps were bimodal in one process
(78-83 or 98-107 ms, ``bench/results/h200_6c7a326_session45/ab_speed4_aa20f39.txt``). For each
step this prints its GPU time (CUDA events), the host's issue time of the forward and of the
backward, the hooks' host time in each (``stats()["host_s"]``), the CUDA caching allocator's
device allocations, frees, retries and stream syncs, the garbage collections that ran in it
and the offloader's counters that changed in it (waits, stores put off, restores, stash
serves), the page-locked chunks pinned, and the arena's host waits, so slow and fast steps can
be told apart by what they did.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import threading
import time
import traceback

COUNTERS = ("in_flight_waits", "deferred", "restored_prefetch", "restored_on_demand",
            "served_from_stash", "served_held", "offloaded_compressed", "offloaded_raw",
            "offload_failed", "kept_host_full")
ALLOCATOR = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


class StallWatch:
    """Print the Python stacks of the thread that made it, and of the others, to stderr if it
    is not cancelled within ``seconds``. A timer thread that reads the frames holding the GIL
    (``sys._current_frames``): ``faulthandler``'s dump reads them without it and ended the
    process (a segfault) when the watched thread was making frames. So a step stalled inside
    a call that holds the GIL is seen when the call returns: the stacks then are printed."""

    def __init__(self, seconds: float, label: str = "the step"):
        self.ident, self.label = threading.get_ident(), label
        self.timer = threading.Timer(seconds, self._dump, args=(seconds,))
        self.timer.daemon = True
        self.timer.start()

    def _dump(self, seconds: float) -> None:
        frames = sys._current_frames()
        out = [f"Stall: {self.label}'s host part ran past {seconds} s; its stack, then the "
               "others'"]
        for ident in sorted(frames, key=lambda i: i != self.ident):
            if ident != threading.get_ident():
                out.append(f"Thread {ident:#x}:")
                out += [ln.rstrip() for ln in traceback.format_stack(frames[ident])]
        print("\n".join(out), file=sys.stderr, flush=True)

    def cancel(self) -> None:
        """Stop the watch; a dump already under way is finished first (it belongs to this
        step, not to what the caller does next)."""
        self.timer.cancel()
        self.timer.join()


class HostSampler:
    """A sampling profiler of the host: every ``interval`` seconds, while :attr:`label` is
    set, it counts each Python thread's innermost frame, and the innermost frame in
    ``torch_pagecomp``, under that label. Under FSDP2 ``memory``'s host issue time was 24 ms a
    step above a plain copy's on ResNet-50, of which the hooks' own timers saw 12
    (``bench/results/h200x2_96f5538_session48``): where the rest goes is what this shows,
    without timing each function (which moves what it measures). A thread in a C call shows
    its Python caller (a blocked launch as the op that launched it)."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.label: str | None = None
        self.ticks: collections.Counter[str] = collections.Counter()
        self.wall: collections.Counter[str] = collections.Counter()  # seconds sampled
        self.leaf: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.ours: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.main = threading.get_ident()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        me, last = threading.get_ident(), time.perf_counter()
        while not self._stop.wait(self.interval):
            now, label = time.perf_counter(), self.label
            dt, last = now - last, now
            if label is None:
                continue
            self.ticks[label] += 1
            self.wall[label] += dt
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                who = "main" if ident == self.main else "other"
                self.leaf[label][(who, _frame_name(frame))] += 1
                f = frame
                while f is not None and "torch_pagecomp" not in f.f_code.co_filename:
                    f = f.f_back
                self.ours[label][(who, _frame_name(f) if f is not None else "-")] += 1

    def close(self) -> None:
        self._stop.set()
        self.thread.join()

    def table(self, label: str, steps: int, top: int = 14) -> list[str]:
        """The ``top`` frames of ``label``'s samples in ms a step (samples times the measured
        interval, over ``steps``): the innermost frame, the innermost frame in
        ``torch_pagecomp`` by function, and the same by line."""
        ticks = self.ticks[label]
        if not ticks or not steps:
            return [f"{label}: no samples"]
        ms = self.wall[label] / ticks * 1e3 / steps
        by_function: collections.Counter = collections.Counter()
        for (who, name), n in self.ours[label].items():
            by_function[(who, name.rsplit(":", 1)[0] if name != "-" else name)] += n
        columns = [self.leaf[label].most_common(top), by_function.most_common(top),
                   self.ours[label].most_common(top)]
        out = [f"#### {label}: {ticks} samples, {ms * ticks:.1f} ms a step sampled",
               "| thread | innermost frame | ms a step | | thread | innermost in "
               "torch_pagecomp | ms a step | | thread | the same, by line | ms a step |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for i in range(max(len(c) for c in columns)):
            cells = [f"{c[i][0][0]} | {c[i][0][1]} | {c[i][1] * ms:.2f}" if i < len(c)
                     else " | | " for c in columns]
            out.append(f"| {' | | '.join(cells)} |")
        return out


def _frame_name(frame) -> str:
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}:{frame.f_lineno}"


def measure(name: str, arm: str, steps: int, warmup: int, device: str | None = None,
            retune: int | None = None, growth: int | None = None,
            stall_s: float | None = None) -> list[str]:
    """The per-step table of ``arm`` (``uncompressed``, ``memory``, ``speed``) on ``name``.

    ``retune`` (``speed``): its tuner times both ways again after that many passes (so a
    retune's cost shows in a short run), ``growth``: ``_tune.RETUNE_GROWTH`` for this run (1:
    every ``retune`` passes, as before the wait doubled). ``stall_s``: a step whose host part
    (forward and backward issue) runs longer than this prints the Python stacks of this thread
    and of the others then (:class:`StallWatch`), to see where a stalled step's host waits."""
    import torch

    from bench.stock_models import build, variant_settings
    from torch_pagecomp import ActivationOffloader, offload_module

    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    where = "cuda" if cuda else "cpu"
    model, x, blocks = build(name, where)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    kw = variant_settings(arm, where)
    if retune is not None:
        from torch_pagecomp import StepTuner

        if arm != "speed":
            raise ValueError("retune: only the speed arm has a tuner")
        kw["tuner"] = StepTuner(retune=retune)
    from torch_pagecomp.offload import _tune

    real_growth = _tune.RETUNE_GROWTH
    if growth is not None:
        _tune.RETUNE_GROWTH = growth  # for this run only: a probe (restored below)
    off = ActivationOffloader(**kw)
    offload_module(model, blocks=blocks, offloader=off)
    group_s = [0.0]  # host time in the group ends (where held batches are stored)
    real_next_group = off.next_group

    def timed_next_group() -> None:
        t = time.perf_counter()
        try:
            real_next_group()
        finally:
            group_s[0] += time.perf_counter() - t

    off.next_group = timed_next_group  # the blocks' pre-hooks look it up at each call
    collected = collections.Counter()

    def on_gc(phase: str, info: dict) -> None:
        if phase == "stop":
            collected[info["generation"]] += 1

    def waited_us() -> int:
        return sum(st.arena.wait_s for st in off._paged.values()) * 1e6

    def allocator() -> tuple[int, ...]:
        """The CUDA caching allocator's device allocations, frees, retries and syncs so far."""
        if not cuda:
            return (0, 0, 0, 0)
        st = torch.cuda.memory_stats()
        return tuple(st.get(k, 0) for k in ALLOCATOR)

    def step() -> dict:
        before, host0 = off.counters.copy(), dict(off._host_s)
        made0, wait0 = off.host_buffers_made(), waited_us()
        alloc0, group0 = allocator(), group_s[0]
        collected.clear()
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        watch = StallWatch(stall_s) if stall_s else None
        try:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model(x).float().square().mean()
            t1 = time.perf_counter()
            if cuda:
                em = torch.cuda.Event(enable_timing=True)
                em.record()
            loss.backward()
            opt.step()
            t2 = time.perf_counter()
        finally:
            if watch is not None:
                watch.cancel()
        if cuda:
            e1.record()
            e1.synchronize()
        delta = off.counters - before
        return {"ms": e0.elapsed_time(e1) if cuda else (t2 - t0) * 1e3,
                "gpu_fwd": e0.elapsed_time(em) if cuda else float("nan"),
                "fwd": (t1 - t0) * 1e3, "bwd": (t2 - t1) * 1e3,
                "pack": (off._host_s["pack"] - host0["pack"]) * 1e3,
                "groups": (group_s[0] - group0) * 1e3,
                "unpack": (off._host_s["unpack"] - host0["unpack"]) * 1e3,
                "alloc": tuple(b - a for a, b in zip(alloc0, allocator())),
                "gc": dict(collected), "made": off.host_buffers_made() - made0,
                "wait": waited_us() - wait0,
                "counts": {k: delta[k] for k in COUNTERS if delta[k]},
                "tuner": (f"{off.tuner.arm} ({off.tuner.summary()['phase']})"
                          if off.tuner is not None else "")}

    gc.callbacks.append(on_gc)
    try:
        for _ in range(warmup):
            step()
        rows = [step() for _ in range(steps)]
    finally:
        gc.callbacks.remove(on_gc)
        off.remove()
        _tune.RETUNE_GROWTH = real_growth
    med = statistics.median(r["ms"] for r in rows)
    lines = [f"## {name} {arm}: {steps} steps after {warmup} warm-up (median {med:.1f} ms, "
             f"total {sum(r['ms'] for r in rows):.0f} ms; 'slow' = over 1.1x the median)",
             "| step | ms | slow | GPU fwd ms | host fwd ms | of it pack hooks | group ends | "
             "host bwd ms | of it unpack hooks | gc (gen: runs) | cudaMalloc, cudaFree, "
             "retries, syncs | pinned | arena waits us | counters | tuner: arm (phase) |",
             "|---" * 15 + "|"]
    for i, r in enumerate(rows):
        lines.append(f"| {i} | {r['ms']:.1f} | {'yes' if r['ms'] > 1.1 * med else ''} | "
                     f"{r['gpu_fwd']:.1f} | {r['fwd']:.1f} | {r['pack']:.1f} | "
                     f"{r['groups']:.1f} | {r['bwd']:.1f} | "
                     f"{r['unpack']:.1f} | "
                     f"{r['gc']} | {r['alloc']} | "
                     f"{r['made']} | {r['wait']:.0f} | {r['counts']} | {r['tuner']} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tv-resnet50")
    ap.add_argument("--arm", default="memory", choices=("uncompressed", "memory", "speed"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--retune", type=int, default=None,
                    help="speed: its tuner retunes after this many passes")
    ap.add_argument("--growth", type=int, default=None,
                    help="speed: the retune wait's longest multiple (1: a fixed wait)")
    ap.add_argument("--stall-dump", type=float, default=None,
                    help="seconds: a step's host part running longer prints its Python stacks")
    a = ap.parse_args()
    for name in a.models.split(","):
        print("\n".join(measure(name, a.arm, a.steps, a.warmup, retune=a.retune,
                                 growth=a.growth, stall_s=a.stall_dump)), flush=True)


if __name__ == "__main__":
    main()
