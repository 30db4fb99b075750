r"""A small program for ``ncu``: compresses and decodes 64 MiB of one corpus three times each.

``ncu --clock-control none --section SchedulerStats --section WarpStateStats -k regex:_lz4_\|_dec
--launch-skip 2 --launch-count 2 python3 -m bench.dev_ncu_target text``.
"""

from __future__ import annotations

import sys

import torch

from bench.corpora import build_corpus, element_size
from torch_pagecomp.kernels import lz4_compress as C
from torch_pagecomp.kernels import lz4_decompress as D


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "text"
    e = element_size(name)
    pages = build_corpus(name, 64 << 20, 4096, "cuda", seed=7)
    n, p = pages.shape
    offsets = torch.arange(n, device="cuda", dtype=torch.int64) * p
    out = torch.empty_like(pages)
    status = torch.empty(n, dtype=torch.int32, device="cuda")
    for _ in range(3):
        payload, sizes, kinds = C.compress_pages(pages, e)
    for _ in range(3):
        D.decompress_into(payload.view(-1), offsets, sizes, kinds, out, status)
    torch.cuda.synchronize()
    assert bool((status == 0).all()) and torch.equal(out, pages)
    print(name, "ok")


if __name__ == "__main__":
    main()
