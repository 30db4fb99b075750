"""Probe: how fast do kernel stores reach page-locked host memory, by number of programs?

The compressed activation store writes its pages to host memory from a few persistent
programs (``torch_pagecomp.kernels.host_pack``). This times that kernel (plan and pack of one
slice; each run places the slice at the same place: the arena's end is read from one slot and
written to the other) on compressed
bf16-like pages against a plain device-to-host copy of the same bytes, for several program
counts, and checks that the written bytes round-trip (the chunk is registered with
``cudaHostRegister`` and addressed by its host pointer). Also times a bf16 matrix product
alone and beside the pack kernel, to see what the pack costs the model's compute.

    python -m bench.dev_host_write_probe --mib 256
"""

from __future__ import annotations

import argparse

import torch

from torch_pagecomp import _ops
from torch_pagecomp.kernels.host_pack import pack_slice
from torch_pagecomp.pools import HostMemory


def ms_per_call(fn, reps: int = 5) -> float:
    """GPU milliseconds per call of ``fn`` on the current stream (one warm call first)."""
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--programs", default="2,4,8,16,32,64,132")
    args = ap.parse_args()
    P, n = 4096, (args.mib << 20) // 4096
    x = (torch.randn(n * P // 2, device="cuda") * 0.02).to(torch.bfloat16)
    pages = x.view(torch.uint8).view(n, P)
    payload, sizes, kinds = _ops.compress_eager(pages, 2)
    chunk = 1 << 30
    mem = HostMemory(chunk, pin=True)
    table = torch.zeros(1, dtype=torch.int64, device="cuda")
    table[0] = mem.tensor.data_ptr()
    ends = torch.zeros(2, dtype=torch.int64, device="cuda")
    rel = torch.empty(n, dtype=torch.int64, device="cuda")
    desc = torch.empty(2, dtype=torch.int64, device="cuda")
    host_desc = torch.empty(2, dtype=torch.int64, pin_memory=True)

    def pack(programs=None):
        pack_slice(payload, sizes, rel, ends, 0, chunk, desc, host_desc, table, chunk,
                   programs=programs)

    pack()
    torch.cuda.synchronize()
    base, total = host_desc.tolist()
    print(f"pages {n}, compressed {total / 2**20:.1f} MiB of {n * P / 2**20:.0f} MiB "
          f"(ratio {n * P / total:.3f}), host memory pinned={mem.pinned}")

    dst = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    src = torch.empty(total, dtype=torch.uint8, device="cuda")
    ms = ms_per_call(lambda: dst.copy_(src, non_blocking=True))
    print(f"copy D2H {total / ms / 1e6:7.1f} GB/s (compressed bytes)")
    up = ms_per_call(lambda: src.copy_(dst, non_blocking=True))
    print(f"copy H2D {total / up / 1e6:7.1f} GB/s (compressed bytes)")
    for g in [int(v) for v in args.programs.split(",")]:
        mem.tensor[:total].fill_(0)
        ms = ms_per_call(lambda g=g: pack(g))
        got = mem.tensor[:total].cuda()
        ok = all(
            torch.equal(got[int(rel[i]):int(rel[i]) + int(sizes[i])], payload[i, :int(sizes[i])])
            for i in torch.randint(0, n, (64,)).tolist()
        )
        print(f"plan + pack to host, {g:3d} programs: {total / ms / 1e6:7.1f} GB/s  bytes ok={ok}")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    mm = ms_per_call(lambda: a @ a, reps=10)
    for g in (8, 16, 32):
        def both(g=g):
            with torch.cuda.stream(side):
                pack(g)
            return a @ a
        t = ms_per_call(both, reps=10)
        print(f"8192^3 bf16 matmul {mm:.2f} ms alone, {t:.2f} ms beside the pack ({g} programs)")


if __name__ == "__main__":
    main()
