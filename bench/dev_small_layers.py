"""Dev probe (#26): a small ``offload`` + ``restore``'s host time, layer by layer, and the
host cost of each primitive the small store's path issues.

``python3 -m bench.dev_small_layers [--kib 1024] [--calls 400] [--rounds 10]`` (GPU). Each
layer is timed the way ``bench.latency`` times ``offload_restore``: one call at a time on an
idle GPU (synchronised before each), its free untimed; median host us (``perf_counter_ns``)
and median end-to-end us (CUDA events). The layers take turns, ``--rounds`` rounds of
``calls / rounds`` calls each (the host's speed drifts within a run). Layers, outermost
first:

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

import torch

import torch_pagecomp as pc
from bench.corpora import build_corpus
from bench.latency import time_calls
from bench.timing import host_rounds_us


def one_at_a_time(fn, after, calls: int, warm: int = 2) -> tuple[list, list]:
    """``(host us, e2e us)`` of ``calls`` calls of ``fn`` (after ``warm`` untimed), each
    alone on an idle GPU, as ``bench.latency`` times them; ``after(result)`` after each."""
    host, e2e = time_calls(fn, torch.device("cuda"), calls, warm, float("inf"), after)
    return [t * 1e6 for t in host], [t * 1e6 for t in e2e]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=10)
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

    pinned = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)

    def copy():
        pinned.copy_(src, non_blocking=True)
        out.copy_(pinned, non_blocking=True)

    layers = (("PageCompressor offload + restore", full, full_free),
              ("the same, general path (no one-call path)", general, full_free),
              ("DirectPath offload + restore_into", direct, direct_free),
              ("SmallStore offload + restore", store, store_free),
              ("pinned D2H + H2D", copy, lambda _: None))
    for _, fn, after in layers:
        one_at_a_time(fn, after, 0, warm=20)
    # the layers take turns, a.rounds rounds: the host's speed drifts within a run
    host = {name: [] for name, _, _ in layers}
    e2e = {name: [] for name, _, _ in layers}
    x = {name: [] for name, _, _ in layers}  # per round: median e2e over the copy's
    for _ in range(a.rounds):
        got = {name: one_at_a_time(fn, after, a.calls // a.rounds) for name, fn, after in layers}
        copy_e2e = statistics.median(got["pinned D2H + H2D"][1])
        for name, (h, e) in got.items():
            host[name] += h
            e2e[name] += e
            x[name].append(statistics.median(e) / copy_e2e)
    print(f"## {a.kib} KiB bf16-relu, one call at a time ({a.rounds} rounds of "
          f"{a.calls // a.rounds} calls a layer, in turns; medians)")
    print("| layer | host us | e2e us | e2e x copy (median of rounds; min - max) |\n"
          "|---|---|---|---|")
    for name, _, _ in layers:
        print(f"| {name} | {statistics.median(host[name]):.1f} | "
              f"{statistics.median(e2e[name]):.1f} | {statistics.median(x[name]):.2f} "
              f"({min(x[name]):.2f} - {max(x[name]):.2f}) |", flush=True)

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

    # the decoder's launch as the small store makes it (captured from one restore, replayed:
    # it reads the block and writes ``out`` and a status buffer, nothing else)
    from torch_pagecomp.kernels import launch as L
    from torch_pagecomp.offload import _small_store

    caught = []
    orig = _small_store.launch_cached
    _small_store.launch_cached = lambda *args: (caught.append(args), orig(*args))
    try:
        held = comp.offload(t)
        kept.append(comp.restore(held))  # (the replays write it again)
    finally:
        _small_store.launch_cached = orig
    torch.cuda.synchronize()
    cache, key, _, grid, index, _, _, values, _, stream = caught[-1]
    entry = cache[key]

    import triton
    import triton.language as tl

    @triton.jit
    def _one_store(x_ptr):  # the smallest kernel: what any launch costs on this host
        tl.store(x_ptr, 1)

    nop_arg = torch.zeros(1, dtype=torch.int32, device=dev)
    L.launch(_one_store, (1,), dev, (nop_arg,), {}, traced=False)  # compiles, keeps its entry
    cases = {
        "decoder launch: launch_cached (hit)": lambda: orig(*caught[-1]),
        "one-store Triton kernel, kept entry (launch(traced=False))": lambda: L.launch(
            _one_store, (1,), dev, (nop_arg,), {}, traced=False),
        "torch: small.zero_() (one aten kernel)": lambda: status.zero_(),
        "decoder launch: launch_entry alone": lambda: L.launch_entry(entry, grid, index, values,
                                                                    stream.cuda_stream),
        "entries_usable(index)": lambda: L.entries_usable(index),
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
    print(f"\n## primitives (mean of {min(a.calls, 200)} back to back, median of 5 rounds)")
    print("| primitive | host us |\n|---|---|")
    # rounds of at most 200 calls, the GPU synchronised between them: more launches than
    # the launch queue holds (1024) made the host wait for the GPU, which a run of 400 back
    # to back did (the decoder's launch then read 29 us, its kernel's time: session 84)
    calls = min(a.calls, 200)

    def between() -> None:
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # the GPU busy: no call finds it idle

    for name, fn in cases.items():
        for _ in range(20):
            fn()
        between()
        us = statistics.median(host_rounds_us(fn, calls, 5, after=between))
        torch.cuda.synchronize()
        print(f"| {name} | {us:.2f} |", flush=True)
    # how each of the small store's launches is made: Triton's C launch function, or the
    # launcher's Python ``__call__`` (a kernel asking for scratch memory, see
    # ``kernels.launch._raw_launch``)
    print("\n| small store launch key | launch function | arguments before / after the kernel's |"
          " (warps, CTAs, shared bytes) |\n|---|---|---|---|")
    one = next((v for v in L._COMPILED.values() if v and v[0] is _one_store), None)
    for k, e in list(small._launches.items()) + [(("one-store",), one)]:
        if e is None:
            print(f"| {k} | (none kept) | - |")
            continue
        fn = e[1]
        print(f"| {k} | {type(fn).__name__} {getattr(fn, '__qualname__', '')} | "
              f"{len(e[2])} / {len(e[3])} | {e[2][5] if len(e[2]) > 5 else '-'} |", flush=True)
    held.free()
    comp.close()


if __name__ == "__main__":
    main()
