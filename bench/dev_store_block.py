"""Dev probe: does a compressed store make the host wait for the GPU? (#21, session 45)

``python3 -m bench.dev_store_block`` (GPU): a 1 MiB bf16 storage stored by a
``_paged.PagedStore`` while a sleeping kernel (``torch.cuda._sleep``, ~1 s) holds up one of
its streams (the pack stream, the compress stream, the producer's). Prints the host time of
each store: a store that returns in well under the sleep did not wait. ``--cold``: the sleep
comes before the store's second launch ever (its pack kernel at the other slot parity), as
``tests/test_offload_paged.py``'s GPU ``stores_now`` test first did: that store waited out
the whole sleep (1.0 s on an H200, ``bench/results/h200_6c7a326_session45``), warm ones
0.3-3.6 ms (3 ms where the store pinned a chunk).
"""

from __future__ import annotations

import argparse
import time

SLEEP_CYCLES = 2_000_000_000  # ~1 s at an H200's clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true",
                    help="sleep before the second store ever (one warm-up store, not three)")
    a = ap.parse_args()
    import torch

    from torch_pagecomp.offload._paged import PagedStore

    streams = tuple(torch.cuda.Stream() for _ in range(3))
    store = PagedStore(torch.device("cuda"), 4096, streams, chunk_bytes=4 << 20,
                       slice_bytes=1 << 20)
    src = torch.randn(1 << 19, device="cuda").to(torch.bfloat16).view(torch.uint8)
    producer = torch.cuda.current_stream()
    for _ in range(1 if a.cold else 3):
        store.free(store.offload(src, 2, producer=producer))
    torch.cuda.synchronize()
    holds = [("pack", store.pack_stream)] if a.cold else [
        ("pack", store.pack_stream), ("compress", store.compress_stream), ("producer", producer)]
    for name, stream in holds:
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        stored = store.offload(src, 2, producer=producer)
        ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        left = (time.perf_counter() - t0) * 1e3
        print(f"{name} stream held up: store {ms:.1f} ms on the host, then {left:.1f} ms "
              "until the GPU was done", flush=True)
        store.free(stored)
    store.close()


if __name__ == "__main__":
    main()
