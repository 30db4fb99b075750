"""Dev probe: the host cost of the single torch calls the hooks and stores make, warm.

``python3 -m bench.dev_host_micro [--calls 5000]`` (GPU): for each call (a uint8 view of a
storage made three ways, an event recorded or queried, the allocator's counters, the current
stream, ``record_stream``, a stream wait, a cached allocation, a stream context), the best of
three runs of ``--calls`` back-to-back calls, in microseconds a call. These are floors: in a
training step the same calls run with cold caches and cost more. Written to test a
sampler's reading that making a uint8 view of a saved storage
(``ActivationOffloader._offload``: ``torch.empty(0).set_(storage)``) cost 25-40 us a call;
it costs 3.8 us warm on an H200 host (``bench/results/h200_session76``).
"""

from __future__ import annotations

import argparse
import timeit

import torch


def cases(dev: torch.device) -> dict:
    """Name -> a call with no arguments, on ``dev``."""
    t = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    s = t.untyped_storage()
    u8 = torch.uint8
    base = torch.empty((0,), dtype=u8, device=dev)
    side = torch.cuda.Stream(device=dev)
    ev = torch.cuda.Event()
    ev.record()
    default = torch.cuda.default_stream(dev)

    def stream_context() -> None:
        with torch.cuda.stream(side):
            pass

    return {
        "empty(0, cuda).set_(storage)": lambda: torch.empty((0,), dtype=u8, device=dev).set_(s),
        "base.new().set_(storage)": lambda: base.new().set_(s),
        "base.new_empty(0).set_(storage)": lambda: base.new_empty((0,)).set_(s),
        "empty(0, cuda)": lambda: torch.empty((0,), dtype=u8, device=dev),
        "t.untyped_storage()": lambda: t.untyped_storage(),
        "t.view(-1).view(uint8)": lambda: t.view(-1).view(u8),
        "Event().record()": lambda: torch.cuda.Event().record(),
        "event.query()": lambda: ev.query(),
        "torch._C._cuda_memoryStats": lambda: torch._C._cuda_memoryStats(dev.index or 0),
        "current_stream()": lambda: torch.cuda.current_stream(dev),
        "t.record_stream(side)": lambda: t.record_stream(side),
        "is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "empty(64 MiB), cached": lambda: torch.empty(64 << 20, dtype=u8, device=dev),
        "empty(416 KiB), cached": lambda: torch.empty(416 << 10, dtype=u8, device=dev),
        "side.wait_event(event)": lambda: side.wait_event(ev),
        "with torch.cuda.stream(side)": stream_context,
        "default.wait_stream(side)": lambda: default.wait_stream(side),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    for name, fn in cases(dev).items():
        for _ in range(200):
            fn()
        best = min(timeit.repeat(fn, number=a.calls, repeat=3)) / a.calls * 1e6
        print(f"{name:40s} {best:7.2f} us", flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
