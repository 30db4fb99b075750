"""Dev probe: where one small call's host time goes (issue #26).

``python3 -m bench.dev_call_profile [--kib 1024] [--calls 500]`` (GPU): cProfile's top functions
over ``--calls`` calls each of ``torch_pagecomp.compress`` and ``decompress(return_status=True)``
on one bf16 tensor, GPU synchronised before each profile only (the calls queue up, as a
program's would).
"""

from __future__ import annotations

import argparse

import torch

import torch_pagecomp as pc
from bench.corpora import build_corpus
from bench.dev_host_profile import profile_calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=500)
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = build_corpus("bf16-relu", a.kib << 10, 4096, dev, seed=1)
    c = pc.compress(x, element_size=2)
    pc.decompress(c, return_status=True)
    torch.cuda.synchronize()
    pattern = "torch_pagecomp|triton_kernels|triton/runtime"
    print("# compress", flush=True)
    print(profile_calls(lambda: pc.compress(x, element_size=2), a.calls, 25, pattern))
    print("# decompress(return_status=True)", flush=True)
    print(profile_calls(lambda: pc.decompress(c, return_status=True), a.calls, 25, pattern))


if __name__ == "__main__":
    main()
