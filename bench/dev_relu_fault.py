"""Which kernel faults on bf16-relu pages compressed as bytes (element size 1)?

``python3 -m bench.dev_relu_fault '<compress kwargs JSON>' <lean>``: builds 64 MiB of the
corpus on the GPU, compresses, synchronises, decodes with ``decompress_into(lean=...)``,
synchronises, and checks every page.
"""
import json
import sys

import torch

from bench.corpora import build_corpus
from triton_kernels import lz4_compress as C
from triton_kernels import lz4_decompress as D

kw = json.loads(sys.argv[1])
lean = int(sys.argv[2])
pages = build_corpus("bf16-relu", 64 << 20, 4096, "cuda", seed=int(sys.argv[3]))
n = pages.shape[0]
payload, sizes, kinds = C.compress_pages(pages, 1, **kw)
torch.cuda.synchronize()
print("compressed", kw, flush=True)
out = torch.empty_like(pages)
status = torch.empty(n, dtype=torch.int32, device="cuda")
offsets = torch.arange(n, device="cuda", dtype=torch.int64) * 4096
D.decompress_into(payload.view(-1), offsets, sizes, kinds, out, status, lean=lean)
torch.cuda.synchronize()
print("decoded lean", lean, "ok" if bool((status == 0).all()) and torch.equal(out, pages)
      else "WRONG", flush=True)
