"""Dev check of the timing method: one call per event window (the old harness) against windows
of back-to-back calls (``bench.timing.measure`` now), and the host time per call, for our API,
``decompress_into`` with a reused output, and nvCOMP, per corpus at two sizes.

``python3 -m bench.dev_timing_check [--corpora text,mixed] [--mib 64,128]`` (GPU only).
"""

from __future__ import annotations

import argparse

import torch

import torch_pagecomp as pc
from bench import nvcomp
from bench.corpora import build_corpus
from bench.timing import gbps, host_seconds, measure, median, window_seconds
from torch_pagecomp.kernels import lz4_decompress as D


def _one_size(corpus: str, mib: int, seed: int, nv, dev: torch.device) -> None:
    pages = build_corpus(corpus, mib * 2**20, 4096, dev, seed=seed)
    nbytes = pages.numel()
    c = pc.compress(pages)
    out = torch.empty_like(pages)
    st = torch.empty(pages.shape[0], dtype=torch.int32, device=dev)
    offs = c.page_offsets()
    plan = nvcomp.LZ4Plan(nv, pages, 1)
    plan.compress()
    ops = {
        ("pagecomp", "compress"): lambda: pc.compress(pages),
        ("pagecomp", "decompress"): lambda: pc.decompress(c, return_status=True),
        ("pagecomp", "decompress_into"): lambda: D.decompress_into(
            c.payload.view(-1), offs, c.sizes, c.kinds, out, st),
        ("nvcomp", "compress"): plan.compress,
        ("nvcomp", "decompress"): plan.decompress,
    }
    for (codec, op), fn in ops.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        one = median([window_seconds(fn, 1) for _ in range(10)])
        many = median(measure(fn, dev, 10, 2))
        host = host_seconds(fn, dev) * 1e6
        print(f"| {corpus} | {mib} | {codec} | {op} | {gbps(nbytes, one):.1f}"
              f" | {gbps(nbytes, many):.1f} | {host:.0f} |", flush=True)
    del plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpora", default="text,mixed")
    ap.add_argument("--mib", default="64,128")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    dev = torch.device("cuda")
    nv, why = nvcomp.load()
    assert nv is not None, why
    print("| corpus | MiB | codec | op | 1 call/window GB/s | back-to-back GB/s | host us/call |")
    print("|---|---|---|---|---|---|---|")
    for corpus in a.corpora.split(","):
        for mib in (int(m) for m in a.mib.split(",")):
            _one_size(corpus, mib, a.seed, nv, dev)


if __name__ == "__main__":
    main()
