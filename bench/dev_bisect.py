"""Bisect a compressor fault: compress text pages with one tuning (argv JSON), sync, decode."""
import json
import sys

import numpy as np
import torch

from torch_pagecomp import format as fmt
from triton_kernels import lz4_compress as lc
from triton_kernels import lz4_decompress as D

kw = json.loads(sys.argv[1])
text = np.frombuffer(open(fmt.__file__, "rb").read() * 64, dtype=np.uint8)
bad = 0
for seed in range(int(sys.argv[2]) if len(sys.argv) > 2 else 8):
    print("seed", seed, flush=True)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - 4096, (512,), generator=g)
    rows = [torch.from_numpy(text[s: s + 4096].copy()) for s in starts.tolist()]
    pages = torch.stack(rows).cuda()
    payload, sizes, kinds = lc.compress_pages(pages, 1, **kw)
    torch.cuda.synchronize()
    out, st = D.decompress_pages(payload.view(-1), torch.arange(512, device="cuda") * 4096, sizes,
                                 kinds, 4096)
    torch.cuda.synchronize()
    ok = bool((st == 0).all()) and torch.equal(out, pages)
    bad += not ok
print(kw, "OK" if not bad else f"WRONG in {bad} seeds", flush=True)
