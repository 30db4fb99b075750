"""Dev probe: our GPU LZ4 decoder on nvCOMP's own LZ4 blocks, page by page (needs a GPU and
nvCOMP).

``bench.dev_decompress_probe`` marked our decoder's output of nvCOMP's blocks wrong on the
``binary`` and ``mixed`` corpora at 14c2459 (right on ``text``). This probe says which pages
fail, with which status, whether the CPU ``lz4`` library decodes the same blocks to the same
pages (are they valid LZ4?), and writes the first failing blocks with their pages to
``--save`` (``.npz``) to reproduce them without a GPU. Its answer (f2db0f7 and 622b0b3 alike,
``bench/results/h200_d04bdbf_session34``): every failing block was one of over ``P - P/32``
bytes (3976-4114), which the format then refused as an LZ4 page (``STATUS_BAD_SIZE``); the
decoders now read any block up to ``LZ4_compressBound(P)``, and this probe finds none failing.

    python3 -m bench.dev_nv_blocks --corpora binary,mixed --mib 32 --save $OUT/nv_fail.npz
"""

from __future__ import annotations

import argparse
import collections

import lz4.block
import numpy as np
import torch

from bench import nvcomp
from bench.corpora import build_corpus
from torch_pagecomp import format as fmt
from torch_pagecomp.kernels import lz4_decompress as D


def probe(name: str, mib: float, seed: int, keep: int) -> tuple[dict, list]:
    nv, why = nvcomp.load()
    if nv is None:
        raise SystemExit(f"nvCOMP unavailable: {why}")
    pages = build_corpus(name, int(mib * 2**20), 4096, "cpu", seed=seed).cuda()
    n, p = pages.shape
    plan = nvcomp.LZ4Plan(nv, pages, 1)
    plan.compress()
    torch.cuda.synchronize()
    blocks = plan.out.view(n, -1)
    sizes = plan.sizes.to(torch.int32)
    offsets = torch.arange(n, device="cuda", dtype=torch.int64) * plan.stride
    kinds = torch.full((n,), fmt.KIND_LZ4, dtype=torch.uint8, device="cuda")
    out = torch.full_like(pages, 0xA5)
    status = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    D.decompress_into(plan.out.view(-1), offsets, sizes, kinds, out, status)
    torch.cuda.synchronize()
    bad = ((status != 0) | (out != pages).any(dim=1)).nonzero().flatten().tolist()
    row = {"corpus": name, "pages": n, "failing": len(bad),
           "statuses": dict(collections.Counter(status[bad].tolist())),
           "nv_sizes_of_failing": sorted(collections.Counter(sizes[bad].tolist()).items())[:8]}
    cpu_ok, saved = 0, []
    for i in bad:
        block = blocks[i, : int(sizes[i])].cpu().numpy().tobytes()
        want = pages[i].cpu().numpy().tobytes()
        try:
            ok = lz4.block.decompress(block, uncompressed_size=p) == want
        except lz4.block.LZ4BlockError:
            ok = False
        cpu_ok += ok
        if len(saved) < keep:
            saved.append((block, pages[i].cpu().numpy(), out[i].cpu().numpy(), int(status[i])))
    row["cpu_lz4_decodes_them"] = cpu_ok
    if bad:
        first = saved[0]
        diff = np.flatnonzero(first[1] != first[2])
        row["first_bad_byte"] = int(diff[0]) if diff.size else None
    return row, saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpora", default="binary,mixed,text")
    ap.add_argument("--mib", type=float, default=32)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--keep", type=int, default=16)
    ap.add_argument("--save", default=None)
    a = ap.parse_args()
    blocks, originals, decoded, statuses = [], [], [], []
    for name in a.corpora.split(","):
        row, saved = probe(name, a.mib, a.seed, a.keep)
        print(row, flush=True)
        for block, orig, dec, st in saved:
            blocks.append(np.frombuffer(block, dtype=np.uint8))
            originals.append(orig)
            decoded.append(dec)
            statuses.append(st)
    if a.save and blocks:
        np.savez_compressed(a.save, sizes=np.array([b.size for b in blocks]),
                            blocks=np.concatenate(blocks), originals=np.stack(originals),
                            decoded=np.stack(decoded), statuses=np.array(statuses))
        print(f"saved {len(blocks)} failing blocks to {a.save}")


if __name__ == "__main__":
    main()
