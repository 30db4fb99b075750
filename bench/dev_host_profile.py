"""Dev profile of host time: where the Python side of the ops and of a pipeline restore goes.

``python3 -m bench.dev_host_profile [--mib 32]`` (GPU only): host microseconds per call of each
op on one batch, then cProfile's top functions over many calls and over pipeline restores.

``--enqueue [--mib 64]``: instead, host microseconds of each piece of the pipeline's per-batch
enqueue on one batch of bf16 pages (median of 40 calls, GPU idle at the start of each), then a
whole one-batch offload's submit (the caller's part) and until stored.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import torch_pagecomp as pc
from bench.corpora import build_corpus
from bench.timing import host_seconds
from torch_pagecomp import PageCompressor
from torch_pagecomp._ops import compress_eager, pack_eager


def profile_calls(fn, calls: int, top: int = 22, cumulative: str | None = None) -> str:
    """cProfile's top functions (by own time) over ``calls`` calls of ``fn``; with
    ``cumulative`` (a regex of file names), also those functions by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(top)
    if cumulative:
        stats.sort_stats("cumulative").print_stats(cumulative, top + 15)
    return s.getvalue()


def enqueue_cost(mib: int, dev: torch.device) -> None:
    """Host us of each piece of a batch's enqueue in the pipeline (``--enqueue``)."""
    x = build_corpus("bf16-randn", mib << 20, 4096, dev, seed=1)
    pages = x.view(-1, 4096)
    comp = PageCompressor(device=dev, batch_pages=pages.shape[0])
    p = comp.pipeline
    ev = torch.cuda.Event(enable_timing=True)
    payload, sizes, kinds = compress_eager(pages, 2)
    packed, offsets = pack_eager(payload, sizes)
    meta = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    n = pages.shape[0]

    def ctx():
        with torch.cuda.stream(p.compute):
            pass

    def meta_copies():
        meta[: 8 * (n + 1)].view(torch.int64).copy_(offsets, non_blocking=True)
        meta[8 * (n + 1) : 8 * (n + 1) + 4 * n].view(torch.int32).copy_(sizes, non_blocking=True)
        meta[12 * n + 8 : 13 * n + 8].copy_(kinds, non_blocking=True)

    def submit():
        comp.offload(x, element_size=2)

    pieces = {
        "torch.cuda.stream ctx": ctx,
        "Event.record": lambda: ev.record(p.compute),
        "Stream.wait_event": lambda: p.d2h.wait_event(ev),
        "torch.empty 64 MiB": lambda: torch.empty(n * 4096, dtype=torch.uint8, device=dev),
        "compress_eager (e=2)": lambda: compress_eager(pages, 2),
        "pack_eager": lambda: pack_eager(payload, sizes),
        "3 metadata copies": meta_copies,
        "record_stream": lambda: packed.record_stream(p.d2h),
        "staging acquire+release": lambda: p.staging.release(p.staging.acquire(1 << 20)),
        "offload submit (1 batch)": submit,
    }
    for name, fn in pieces.items():
        fn()
        print(f"host us {name:28s} {host_seconds(fn, dev, 40) * 1e6:8.1f}", flush=True)
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = comp.offload(x, element_size=2)
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        print(f"one-batch offload: submit {1e6 * (t1 - t0):.0f} us, "
              f"stored {1e6 * (t2 - t0):.0f} us")
        h.free()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=None, help="default 32 (64 with --enqueue)")
    ap.add_argument("--enqueue", action="store_true", help="the pipeline's per-batch pieces")
    a = ap.parse_args()
    dev = torch.device("cuda")
    if a.enqueue:
        enqueue_cost(a.mib or 64, dev)
        return
    a.mib = a.mib or 32
    pages = build_corpus("mixed", a.mib << 20, 4096, dev, seed=3)
    n = pages.shape[0]
    c = pc.compress(pages)
    payload, offsets, sizes, kinds = c.payload.view(-1), c.page_offsets(), c.sizes, c.kinds
    ops = {
        "torch.empty(uint8, N*P)": lambda: torch.empty(n * 4096, dtype=torch.uint8, device=dev),
        "ops.compress": lambda: torch.ops.pagecomp.compress(pages, 1),
        "ops.pack": lambda: torch.ops.pagecomp.pack(c.payload, sizes),
        "ops.decompress": lambda: torch.ops.pagecomp.decompress(payload, offsets, sizes, kinds,
                                                                 4096),
        "pc.decompress(status)": lambda: pc.decompress(c, return_status=True),
    }
    for name, fn in ops.items():
        fn()
        print(f"host us/call {name:26s} {host_seconds(fn, dev, 50) * 1e6:8.1f}", flush=True)
    print(profile_calls(ops["ops.decompress"], 200))
    x = build_corpus("mixed", 1 << 30, 4096, dev, seed=4)
    comp = PageCompressor(device=dev)
    h = comp.offload(x)
    h.wait()
    for _ in range(2):
        comp.restore(h)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        comp.restore(h)
    torch.cuda.synchronize()
    print(f"restore 1 GiB mixed: {(time.perf_counter() - t0) / 5 * 1e3:.2f} ms wall, "
          f"batch_pages {comp.batch_pages}")
    print(profile_calls(lambda: comp.restore(h), 5, 30))
    t0 = time.perf_counter()
    for _ in range(3):
        comp.offload(x).wait()
    print(f"offload 1 GiB mixed: {(time.perf_counter() - t0) / 3 * 1e3:.2f} ms wall")
    print(profile_calls(lambda: comp.offload(x).wait(), 3, 30))


if __name__ == "__main__":
    main()
