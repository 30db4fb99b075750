"""Dev probe: the host cost of the CUDA and PyTorch primitives one small call is made of (#26).

``python3 -m bench.dev_host_floor [--calls 2000] [--ab-rounds 10]`` (GPU): the median host time
(``perf_counter_ns`` over a loop of ``--calls``, the GPU busy with queued work so no call waits
on it) of each primitive the compress / decompress calls and the offload store issue: a CUDA
``torch.empty``, a pinned one, a view, an event record, a stream switch, ``record_stream``, a
direct Triton launch of the compress kernel, and the public calls themselves. Tells which of
#26's 30 us a call can reach by trimming Python and which it cannot without CUDA graphs.

``--ab-rounds``: then the direct launch as it was at 1544c8c (:func:`launch_compiled_1544c8c`:
tensors handed to Triton's ``CudaLauncher``, which calls ``data_ptr`` and the driver per pointer
argument) against the package's, alternated in one process (a host's speed drifts by tens of
percent within a device call, so two runs apart compare nothing), on the compress kernel with
its outputs and scratch given and on the two-launch decoder.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import torch_pagecomp as pc
from bench.timing import host_rounds_us


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean host time of ``calls`` calls of ``fn``."""
    return statistics.median(host_rounds_us(fn, calls, rounds))


def launch_compiled_1544c8c(kernel, grid, index, args, meta) -> None:
    """``torch_pagecomp.kernels.launch._launch_compiled`` at 1544c8c (its cache apart)."""
    from torch_pagecomp.kernels import launch as L

    mkey = meta if type(meta) is L.FrozenMeta else L._meta_key(meta)
    classes = tuple(map(L._arg_class, args))
    if mkey is None or None in classes or L._hooks_set():
        kernel[grid](*args, **meta)
        return
    key = (kernel, index, mkey, classes)
    entry = _OLD.get(key, False)
    if entry is False:
        compiled = kernel[grid](*args, **meta)
        entry = _OLD[key] = (compiled.run, compiled.function, compiled.packed_metadata,
                             L._direct_entry(kernel, compiled, index, args, meta)[3])
        return
    run, function, packed, tail = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(index), function, packed, None, None,
        None, *args, *tail)


_OLD: dict = {}


def ab_launch(cases: dict, rounds: int, calls: int) -> None:
    """Each case's host us per call with the old and the new direct launch, alternated."""
    from torch_pagecomp.kernels import launch as L

    new = L._launch_compiled
    times = {(name, side): [] for name in cases for side in ("1544c8c", "new")}
    try:
        for r in range(rounds):
            for side in (("1544c8c", "new") if r % 2 == 0 else ("new", "1544c8c")):
                L._launch_compiled = launch_compiled_1544c8c if side == "1544c8c" else new
                for name, fn in cases.items():
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                    times[(name, side)].append(per_call_us(fn, calls, rounds=1))
                    torch.cuda.synchronize()
    finally:
        L._launch_compiled = new
    print(f"\n| call ({rounds} alternated rounds of {calls}) | 1544c8c launch us | new us | "
          "new / old |\n|---|---|---|---|")
    for name in cases:
        old_us = statistics.median(times[(name, "1544c8c")])
        new_us = statistics.median(times[(name, "new")])
        print(f"| {name} | {old_us:.1f} | {new_us:.1f} | {new_us / old_us:.2f} |", flush=True)


def _on(stream) -> None:
    with torch.cuda.stream(stream):
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--ab-rounds", type=int, default=0)
    a = ap.parse_args()
    dev = torch.device("cuda")
    from bench.corpora import build_corpus
    from torch_pagecomp._ops import compress_eager, decompress_eager
    from torch_pagecomp.kernels.lz4_compress import (
        compress_config,
        compress_pages,
        compress_scratch,
        max_programs,
    )

    x = build_corpus("bf16-relu", 1 << 20, 4096, dev, seed=1)
    pages = x.view(-1, 4096)
    n = pages.shape[0]
    cfg = compress_config(4096, 2)
    scratch = compress_scratch(dev, cfg, max_programs(dev, cfg))
    out = (torch.empty((n, 4096), dtype=torch.uint8, device=dev),
           torch.empty((n,), dtype=torch.int32, device=dev),
           torch.empty((n,), dtype=torch.uint8, device=dev))
    c = pc.compress(x, element_size=2)
    flat = c.payload.view(-1)  # the fixed-stride payload as the decoder's flat input
    offsets = torch.arange(n, dtype=torch.int64, device=dev) * 4096
    side = torch.cuda.Stream()
    ev = torch.cuda.Event()
    small = torch.empty(64, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    cases = {
        "torch.empty cuda 1 MiB": lambda: torch.empty((n, 4096), dtype=torch.uint8, device=dev),
        "torch.empty cuda 256 B": lambda: torch.empty(256, dtype=torch.uint8, device=dev),
        "torch.empty pinned 256 B": lambda: torch.empty(256, dtype=torch.uint8,
                                                        pin_memory=True),
        "slice + view": lambda: pages[1:2].view(-1),
        "Event() + record": lambda: torch.cuda.Event().record(),
        "event.record (reused)": lambda: ev.record(),
        "stream.wait_event": lambda: side.wait_event(ev),
        "with torch.cuda.stream(side)": lambda: _on(side),
        "record_stream": lambda: small.record_stream(side),
        "small.zero_() (one aten kernel)": lambda: small.zero_(),
        "compress_pages(out, scratch, direct)": lambda: compress_pages(
            pages, 2, traced=False, out=out, scratch=scratch),
        "compress_pages(direct, allocating)": lambda: compress_pages(pages, 2, traced=False),
        "compress_eager": lambda: compress_eager(pages, 2),
        "pc.compress": lambda: pc.compress(x, element_size=2),
        "decompress_eager": lambda: decompress_eager(flat, offsets, c.sizes, c.kinds, 4096),
        "pc.decompress(return_status)": lambda: pc.decompress(c, return_status=True),
    }
    # the GPU kept busy well past the loop: no call ever waits for a free queue slot either
    # (1024 queued launches would block the host); each case is its own short loop
    print("| primitive | host us / call |\n|---|---|")
    for name, fn in cases.items():
        calls = a.calls if "compress" not in name else a.calls // 4
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        us = per_call_us(fn, calls // 5)
        torch.cuda.synchronize()
        print(f"| {name} | {us:.1f} |", flush=True)
    torch.cuda.synchronize()
    if a.ab_rounds:
        ab_launch({k: cases[k] for k in ("compress_pages(out, scratch, direct)",
                                         "decompress_eager", "pc.compress",
                                         "pc.decompress(return_status)")},
                  a.ab_rounds, a.calls // 20)


if __name__ == "__main__":
    main()
