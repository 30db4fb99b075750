"""Dev: host microseconds of each piece of the pipeline's per-batch work (GPU only).

``python3 -m bench.dev_enqueue_cost [--mib 64]``: one batch of bf16 pages; each piece timed
alone (median of 40 calls, GPU idle at the start of each), then a whole one-batch offload's
submit (the caller's part) and until stored.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.corpora import build_corpus
from bench.timing import host_seconds
from torch_pagecomp import PageCompressor
from torch_pagecomp._ops import compress_eager, pack_eager


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = build_corpus("bf16-randn", a.mib << 20, 4096, dev, seed=1)
    pages = x.view(-1, 4096)
    pc = PageCompressor(device=dev, batch_pages=pages.shape[0])
    p = pc.pipeline
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
        pc.offload(x, element_size=2)

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
        h = pc.offload(x, element_size=2)
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        print(f"one-batch offload: submit {1e6 * (t1 - t0):.0f} us, "
              f"stored {1e6 * (t2 - t0):.0f} us")
        h.free()


if __name__ == "__main__":
    main()
