"""Dev probe: how fast the pack kernel moves a slice's pages into page-locked host memory, by
number of programs, beside a copy-engine copy of the same bytes.

``python3 -m bench.dev_pack_rate`` (GPU): a 32 MiB slice of pages of a given stored size
(full pages, and 70% pages: what bf16 activations compress to), packed by
``kernels.host_pack.pack_slice`` with 16..128 programs, alone and beside a busy compute stream
(the pack stream at the default priority, and at the highest); then the same kernel packing
into device memory followed by a copy-engine copy of the packed bytes, and a plain copy, alone
and beside the matmuls. GB/s of the bytes written to host memory.
"""

from __future__ import annotations

import argparse

import torch

from bench.dev_host_write_probe import ms_per_call


def _rate(fn, nbytes: int, reps: int) -> float:
    """GB/s of ``nbytes`` per call of ``fn``."""
    return nbytes / (ms_per_call(fn, reps) / 1e3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    from torch_pagecomp.kernels.host_pack import pack_slice
    from torch_pagecomp.pools import HostMemory

    P = 4096
    n = (a.mib << 20) // P
    chunk = 1 << 30
    mem = HostMemory(chunk, pin=True)
    table = torch.tensor([mem.tensor.data_ptr()], dtype=torch.int64, device="cuda")
    payload = torch.randint(0, 256, (n, P), dtype=torch.uint8, device="cuda")
    rel = torch.empty(n, dtype=torch.int64, device="cuda")
    desc = torch.empty(2, dtype=torch.int64, device="cuda")
    host_desc = torch.empty(2, dtype=torch.int64, pin_memory=True)
    ends = torch.zeros(2, dtype=torch.int64, device="cuda")
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def busy_then(fn):
        """``fn`` queued beside four 8192^2 matmuls on another stream."""
        def run():
            with torch.cuda.stream(side):
                for _ in range(4):
                    busy @ busy
            fn()
        return run

    low, high = torch.cuda.Stream.priority_range()
    urgent = torch.cuda.Stream(priority=high)
    print(f"card {torch.cuda.get_device_name()}, slice {a.mib} MiB, {n} pages; stream "
          f"priorities {low} (default) .. {high}")
    print("| stored share | programs | GB/s alone | GB/s beside matmuls | the same, pack stream "
          f"at priority {high} |")
    print("|---|---|---|---|---|")
    for share in (1.0, 0.7):
        sizes = torch.full((n,), int(P * share) // 16 * 16, dtype=torch.int32, device="cuda")
        nbytes = int(sizes.sum())
        for programs in (16, 32, 64, 128):
            def pack(sizes=sizes, programs=programs):
                ends.zero_()  # every rep places the slice at the start of the chunk
                pack_slice(payload, sizes, rel, ends, 0, chunk, desc, host_desc, table, chunk,
                           programs=programs)

            alone = _rate(pack, nbytes, a.reps)
            beside = busy_then(pack)
            shared = _rate(beside, nbytes, a.reps)
            with torch.cuda.stream(urgent):
                first = _rate(beside, nbytes, a.reps)
            print(f"| {share:.1f} | {programs} | {alone:.1f} | {shared:.1f} | {first:.1f} |",
                  flush=True)
    host = torch.empty(n * P, dtype=torch.uint8, pin_memory=True)
    flat = payload.view(-1)
    ce = _rate(lambda: host.copy_(flat, non_blocking=True), n * P, a.reps)
    print(f"copy engine, {a.mib} MiB device -> pinned: {ce:.1f} GB/s")

    # the alternative: the same kernel packs into device memory (a compaction, brief on the
    # SMs), then the copy engine moves the packed bytes, which do not contend for SMs (a store
    # would queue that copy once the host has read the slice's placement, without waiting)
    staging = torch.empty(n * P, dtype=torch.uint8, device="cuda")
    dev_table = torch.tensor([staging.data_ptr()], dtype=torch.int64, device="cuda")
    print("| stored share | compaction + copy engine GB/s alone | beside matmuls | "
          "copy engine alone, uncompacted | beside matmuls |")
    print("|---|---|---|---|---|")
    for share in (1.0, 0.7):
        sizes = torch.full((n,), int(P * share) // 16 * 16, dtype=torch.int32, device="cuda")
        nbytes = int(sizes.sum())
        out = host[:nbytes]

        def compact_copy(sizes=sizes, out=out, nbytes=nbytes):
            ends.zero_()
            pack_slice(payload, sizes, rel, ends, 0, n * P, desc, host_desc, dev_table, n * P,
                       programs=32)
            out.copy_(staging[:nbytes], non_blocking=True)

        def copy_only(out=out, nbytes=nbytes):
            out.copy_(flat[:nbytes], non_blocking=True)

        row = [_rate(f, nbytes, a.reps) for f in (compact_copy, busy_then(compact_copy),
                                                  copy_only, busy_then(copy_only))]
        print(f"| {share:.1f} | " + " | ".join(f"{r:.1f}" for r in row) + " |", flush=True)
    mem.release()


if __name__ == "__main__":
    main()
