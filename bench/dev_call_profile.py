"""Dev probe: where one small call's host time goes (issue #26).

``python3 -m bench.dev_call_profile [--kib 1024] [--calls 500] [--ops compress,decompress,
offload_restore]`` (GPU): cProfile's top functions over ``--calls`` calls each of
``torch_pagecomp.compress``, ``decompress(return_status=True)`` and ``PageCompressor.offload`` +
``restore`` + ``free`` on one bf16 tensor, GPU synchronised before each profile only (the calls
queue up, as a program's would).
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
    ap.add_argument("--ops", default="compress,decompress,offload_restore")
    a = ap.parse_args()
    ops = a.ops.split(",")
    dev = torch.device("cuda")
    x = build_corpus("bf16-relu", a.kib << 10, 4096, dev, seed=1)
    c = pc.compress(x, element_size=2)
    pc.decompress(c, return_status=True)
    torch.cuda.synchronize()
    pattern = "torch_pagecomp|triton_kernels|triton/runtime"
    if "compress" in ops:
        print("# compress", flush=True)
        print(profile_calls(lambda: pc.compress(x, element_size=2), a.calls, 25, pattern))
    if "decompress" in ops:
        print("# decompress(return_status=True)", flush=True)
        print(profile_calls(lambda: pc.decompress(c, return_status=True), a.calls, 25, pattern))
    if "offload_restore" in ops:
        comp = pc.PageCompressor()
        t = x.reshape(-1).view(torch.bfloat16)

        def cycle() -> None:
            h = comp.offload(t)
            comp.restore(h)
            h.free()

        for _ in range(20):
            cycle()
        torch.cuda.synchronize()
        print("# PageCompressor.offload + restore + free", flush=True)
        print(profile_calls(cycle, a.calls, 30, pattern))
        comp.close()


if __name__ == "__main__":
    main()
