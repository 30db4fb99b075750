"""Dev probe (#26): a small ``offload`` + ``restore``'s host time, layer by layer, and the
host cost of each primitive the small store's path issues.

``python3 -m bench.dev_small_layers [--kib 1024] [--calls 400]`` (GPU). Each layer is timed
the way ``bench.latency`` times ``offload_restore``: one call at a time on an idle GPU
(synchronised before each), its free untimed; median host us (``perf_counter_ns``) and median
end-to-end us (CUDA events). Layers, outermost first:

* ``PageCompressor``: ``comp.offload(t)`` + ``comp.restore(h)`` (what ``bench.latency`` times),
  then the same with its one-call path (``torch_pagecomp._small_tensor``) off;
* ``DirectPath``: ``offload(src, 2, "bf16")`` + ``restore_into(storage, out)``, ``out`` made
  once;
* ``SmallStore``: ``small.offload(src, False, producer)`` + ``small.restore(stored, out,
  stream)``;
* ``copy``: a pinned D2H + H2D of the same bytes (#26's reference).

The differences between the layers are what each adds. Then the primitives, each in a loop
of ``--calls`` with the GPU busy (median of 5 rounds of the mean): what no Python trim can go
below.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_pagecomp as pc
from bench.corpora import build_corpus
from bench.timing import host_rounds_us


def one_at_a_time(fn, after, calls: int) -> tuple[float, float]:
    """``(host us, e2e us)`` medians of ``calls`` calls of ``fn``, each alone on an idle GPU;
    ``after(result)`` untimed after each."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    host, e2e = [], []
    for i in range(calls + 20):
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter_ns()
        out = fn()
        t1 = time.perf_counter_ns()
        end.record()
        end.synchronize()
        if i >= 20:
            host.append((t1 - t0) / 1e3)
            e2e.append(start.elapsed_time(end) * 1e3)
        after(out)
    return statistics.median(host), statistics.median(e2e)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=400)
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = build_corpus("bf16-relu", a.kib << 10, 4096, dev, seed=1)
    t = x.reshape(-1).view(torch.bfloat16)
    src = t.view(torch.uint8)
    comp = pc.PageCompressor(device=dev)
    h = comp.offload(t)
    assert torch.equal(comp.restore(h, check=True), t)
    h.free()
    path = comp._direct_path()
    small = path.small
    out = torch.empty_like(src)
    kept: list = []

    def full():
        h = comp.offload(t)
        kept[:] = [comp.restore(h)]
        return h

    def full_free(h):
        kept.clear()
        h.free()
        comp.synchronize()

    fast_path = comp._small_tensor

    def general():  # the one-call path off (``torch_pagecomp._small_tensor``)
        comp._small_tensor = None
        try:
            return full()
        finally:
            comp._small_tensor = fast_path

    def direct():
        s = path.offload(src, 2, "bf16")
        kept[:] = [path.restore_into(s, out)]
        return s

    def direct_free(s):
        kept.clear()
        s.release()
        path.synchronize()

    def store():
        producer = torch.cuda.current_stream()
        s = small.offload(src, False, producer)
        kept[:] = [small.restore(s, out, producer)]
        return s

    def store_free(s):
        kept.clear()
        torch.cuda.synchronize()
        small.free(s)

    host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)

    def copy():
        host.copy_(src, non_blocking=True)
        out.copy_(host, non_blocking=True)

    print(f"## {a.kib} KiB bf16-relu, one call at a time (median of {a.calls})")
    print("| layer | host us | e2e us |\n|---|---|---|")
    for name, fn, after in (("PageCompressor offload + restore", full, full_free),
                            ("the same, general path (no one-call path)", general, full_free),
                            ("DirectPath offload + restore_into", direct, direct_free),
                            ("SmallStore offload + restore", store, store_free),
                            ("pinned D2H + H2D", copy, lambda _: None)):
        hu, eu = one_at_a_time(fn, after, a.calls)
        print(f"| {name} | {hu:.1f} | {eu:.1f} |", flush=True)

    from torch_pagecomp._events import handoff, mark
    from torch_pagecomp.module import _not_capturing
    from torch_pagecomp.offload._streams import current_stream

    side = path.compress_stream
    cur = torch.cuda.current_stream()
    block = small.arena.alloc(1 << 20, view=False)
    small.arena.free(block)
    status = torch.empty(256, dtype=torch.int32, device=dev)

    def arena_cycle():
        b = small.arena.alloc(1 << 20, view=False)
        small.arena.shrink(b, 700 << 10)
        small.arena.free(b)

    cases = {
        "mark(stream)": lambda: mark(side),
        "handoff(cur, side)": lambda: handoff(cur, side),
        "current_stream(dev)": lambda: current_stream(dev),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "_not_capturing": lambda: _not_capturing("x"),
        "torch.empty int32 [256] cuda": lambda: torch.empty(256, dtype=torch.int32, device=dev),
        "torch.empty (shape, bf16) cuda": lambda: torch.empty(t.shape, dtype=t.dtype,
                                                              device=dev),
        "detach().resolve_conj().resolve_neg()": lambda: t.detach().resolve_conj()
        .resolve_neg(),
        "contiguous + reshape(-1).view(uint8)": lambda: t.contiguous().reshape(-1)
        .view(torch.uint8),
        "record_stream": lambda: src.record_stream(side),
        "event.query()": lambda: mark(side).query(),
        "arena alloc + shrink + free": arena_cycle,
        "restore_failures.add([status])": lambda: comp.restore_failures.add([status], cur,
                                                                           recorded=True),
    }
    print(f"\n## primitives (mean of {a.calls} back to back, median of 5 rounds)")
    print("| primitive | host us |\n|---|---|")
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda._sleep(50_000_000)  # the GPU busy: no call waits on it
        us = statistics.median(host_rounds_us(fn, a.calls, 5))
        torch.cuda.synchronize()
        print(f"| {name} | {us:.2f} |", flush=True)
    comp.close()


if __name__ == "__main__":
    main()
