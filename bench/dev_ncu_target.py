r"""A small program for ``ncu``: compresses and decodes 64 MiB of one corpus three times each.

``ncu --clock-control none --section SchedulerStats --section WarpStateStats -k regex:_lz4_\|_dec
--launch-skip 2 --launch-count 2 python3 -m bench.dev_ncu_target text``.

With ``--exp`` the exponent codec's kernels on a bf16 corpus instead (``-k regex:_exp_``), and
with ``--tree PATH`` those of another ``triton_kernels`` folder (``bench.dev_exp_encode``'s
trees), so that two trees' kernels are profiled on the same pages.
"""

from __future__ import annotations

import argparse

import torch

from bench.corpora import build_corpus, element_size
from torch_pagecomp.kernels import lz4_compress as C
from torch_pagecomp.kernels import lz4_decompress as D


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", nargs="?", default="text")
    ap.add_argument("--exp", action="store_true", help="the exponent codec (bf16 pages)")
    ap.add_argument("--tree", default=None, help="another triton_kernels folder (with --exp)")
    args = ap.parse_args()
    pages = build_corpus(args.corpus, 64 << 20, 4096, "cuda", seed=7)
    n, p = pages.shape
    offsets = torch.arange(n, device="cuda", dtype=torch.int64) * p
    out = torch.empty_like(pages)
    status = torch.empty(n, dtype=torch.int32, device="cuda")
    if args.exp:
        if args.tree:
            from bench.dev_exp_encode import _tree_module

            X = _tree_module("ncu", args.tree)
        else:
            from torch_pagecomp.kernels import exp_codec as X
        for _ in range(3):
            payload, sizes, kinds = X.compress_exp_pages(pages, False)
        for _ in range(3):
            X.decompress_exp_into(payload.view(-1), offsets, sizes, kinds, out, status)
    else:
        e = element_size(args.corpus)
        for _ in range(3):
            payload, sizes, kinds = C.compress_pages(pages, e)
        for _ in range(3):
            D.decompress_into(payload.view(-1), offsets, sizes, kinds, out, status)
    torch.cuda.synchronize()
    assert bool((status == 0).all()) and torch.equal(out, pages)
    print(args.corpus, "ok")


if __name__ == "__main__":
    main()
