"""Baselines: python-lz4 per page on the CPU (1 thread and a thread pool) and plain copies."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import lz4.block
import numpy as np
import torch

from .timing import gbps, measure, median


def _compress_range(mv: memoryview, p: int, lo: int, hi: int) -> list[bytes]:
    return [lz4.block.compress(mv[i * p : (i + 1) * p], store_size=False) for i in range(lo, hi)]


def _decompress_list(blocks: list[bytes], p: int) -> list[bytes]:
    return [lz4.block.decompress(b, uncompressed_size=p) for b in blocks]


def lz4_cpu(
    pages: torch.Tensor, threads: int, repeats: int, warmup: int, budget_s: float
) -> dict:
    """python-lz4 block compression of each page on its own (default mode, acceleration 1).

    ``pages`` is ``uint8 [N, P]``; it is copied to host memory first (not timed). With
    ``threads > 1`` the pages are split into ``4 * threads`` contiguous runs served by a
    thread pool (python-lz4 releases the GIL). Ratio counts every block as stored, expansion
    included (no raw fallback), as nvCOMP's is.
    """
    host = pages.cpu().contiguous()
    n, p = host.shape
    mv = memoryview(host.numpy()).cast("B")
    cpu = torch.device("cpu")
    if threads <= 1:
        def comp():
            return _compress_range(mv, p, 0, n)

        def decomp(blocks):
            return _decompress_list(blocks, p)
        pool = None
    else:
        pool = ThreadPoolExecutor(max_workers=threads)
        step = -(-n // (4 * threads))
        ranges = [(lo, min(n, lo + step)) for lo in range(0, n, step)]

        def comp():
            parts = pool.map(lambda r: _compress_range(mv, p, *r), ranges)
            return [b for part in parts for b in part]

        def decomp(blocks):
            parts = pool.map(lambda r: _decompress_list(blocks[r[0] : r[1]], p), ranges)
            return [b for part in parts for b in part]
    try:
        blocks = comp()
        ctimes = measure(comp, cpu, repeats, warmup, budget_s)
        dtimes = measure(lambda: decomp(blocks), cpu, repeats, warmup, budget_s)
        ok = b"".join(decomp(blocks)) == bytes(mv)
    finally:
        if pool is not None:
            pool.shutdown()
    stored = sum(len(b) for b in blocks)
    nbytes = n * p
    return {
        "ratio": nbytes / stored,
        "stored_bytes": stored,
        "compress_gbps": gbps(nbytes, median(ctimes)),
        "decompress_gbps": gbps(nbytes, median(dtimes)),
        "compress_s": ctimes,
        "decompress_s": dtimes,
        "roundtrip_ok": ok,
        "verified_pages": n,
        "threads": max(1, threads),
    }


def default_threads() -> int:
    """The CPUs this process may run on (``cpu_codec.usable_cpus``)."""
    from torch_pagecomp.cpu_codec import usable_cpus

    return usable_cpus()


def copies(nbytes: int, device: torch.device, repeats: int, warmup: int, budget_s: float):
    """Copy ceilings for ``nbytes``: pinned D2H and H2D, device-to-device (one-way GB/s).

    On a CPU device only a host ``memcpy`` (``numpy.copyto``) is measured; the others are
    listed as skipped.
    """
    rows = []
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    if device.type != "cuda":
        s_np, d_np = src.numpy(), torch.empty_like(src).numpy()
        t = median(measure(lambda: np.copyto(d_np, s_np), device, repeats, warmup, budget_s))
        rows.append({"name": "host-memcpy", "gbps": gbps(nbytes, t), "seconds": t})
        for name in ("pinned-d2h", "pinned-h2d", "d2d"):
            rows.append({"name": name, "skipped": "needs CUDA"})
        return rows
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src)
    cases = [
        ("pinned-d2h", lambda: host.copy_(src, non_blocking=True)),
        ("pinned-h2d", lambda: dst.copy_(host, non_blocking=True)),
        ("d2d", lambda: dst.copy_(src)),
    ]
    for name, fn in cases:
        t = median(measure(fn, device, repeats, warmup, budget_s))
        row = {"name": name, "gbps": gbps(nbytes, t), "seconds": t}
        if name == "d2d":
            row["gbps_read_plus_write"] = 2 * row["gbps"]
        rows.append(row)
    ok = torch.equal(dst, src)
    for row in rows:
        row["bytes"] = nbytes
        row["copy_ok"] = ok
    return rows
