"""Dev profile of host time: where the Python side of the ops and of a pipeline restore goes.

``python3 -m bench.dev_host_profile [--mib 32]`` (GPU only): host microseconds per call of each
op on one batch, then cProfile's top functions over many calls and over pipeline restores.
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


def _profile(fn, calls: int, top: int = 22) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=32)
    a = ap.parse_args()
    dev = torch.device("cuda")
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
    print(_profile(ops["ops.decompress"], 200))
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
    print(_profile(lambda: comp.restore(h), 5, 30))
    t0 = time.perf_counter()
    for _ in range(3):
        comp.offload(x).wait()
    print(f"offload 1 GiB mixed: {(time.perf_counter() - t0) / 3 * 1e3:.2f} ms wall")
    print(_profile(lambda: comp.offload(x).wait(), 3, 30))


if __name__ == "__main__":
    main()
