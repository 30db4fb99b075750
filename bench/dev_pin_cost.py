"""Dev probe (#21): what pinning and unpinning one host arena chunk costs the host.

``python3 -m bench.dev_pin_cost --mib 64 --reps 6`` (GPU). Sampled under FSDP2 (session 49),
one 64 MiB chunk's ``cudaHostRegister`` took ~54 ms of a step's host time and its
``cudaHostUnregister`` plus unmapping ~17 ms. For anonymous memory mapped plainly and with
``madvise(MADV_HUGEPAGE)`` (transparent huge pages: 512 times fewer pages to fault in and
lock), this times, per chunk: the register (which faults every page in), the unregister, the
unmapping; then one unregister issued while the GPU runs a ~0.5 s kernel (does it wait for
the device?); and ``torch.empty(pin_memory=True)`` of the same size (``cudaHostAlloc``, once:
PyTorch's caching host allocator keeps it) for scale.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time


def _map(nbytes: int, huge: bool) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    return m


def _cycle(nbytes: int, huge: bool) -> tuple[float, float, float]:
    """ms to register, unregister and unmap one mapping of ``nbytes``."""
    import torch

    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    m = _map(nbytes, huge)
    t = torch.frombuffer(m, dtype=torch.uint8)
    rc = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(getattr(rc, "value", rc)) != 0:
        raise RuntimeError(f"cudaHostRegister: {rc}")
    t1 = time.perf_counter()
    cudart.cudaHostUnregister(t.data_ptr())
    t2 = time.perf_counter()
    del t
    m.close()
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def _unregister_beside_kernel(nbytes: int, huge: bool) -> tuple[float, float]:
    """ms of an unregister issued while a long kernel runs, and of that kernel's wait after."""
    import torch

    cudart = torch.cuda.cudart()
    m = _map(nbytes, huge)
    t = torch.frombuffer(m, dtype=torch.uint8)
    cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU clocks
    t0 = time.perf_counter()
    cudart.cudaHostUnregister(t.data_ptr())
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    del t
    m.close()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args()
    nbytes = a.mib << 20
    torch.cuda.init()
    _cycle(1 << 20, False)  # the driver's first registration aside
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    print(f"## pinning a {a.mib} MiB chunk ({torch.cuda.get_device_name()}, transparent huge "
          f"pages: {thp}), median of {a.reps} (min-max)")
    print("| mapping | register ms | unregister ms | unmap ms |\n|---|---|---|---|")
    for huge in (False, True):
        runs = [_cycle(nbytes, huge) for _ in range(a.reps)]
        cells = []
        for k in range(3):
            col = [r[k] for r in runs]
            cells.append(f"{statistics.median(col):.2f} ({min(col):.2f}-{max(col):.2f})")
        print(f"| {'MADV_HUGEPAGE' if huge else 'plain'} | {' | '.join(cells)} |")
    for huge in (False, True):
        un, after = _unregister_beside_kernel(nbytes, huge)
        print(f"unregister while a ~0.5 s kernel runs ({'huge' if huge else 'plain'}): "
              f"{un:.1f} ms, then the kernel's wait {after:.1f} ms")
    t0 = time.perf_counter()
    x = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    print(f"torch.empty(pin_memory=True), {a.mib} MiB, first: "
          f"{(time.perf_counter() - t0) * 1e3:.2f} ms")
    del x


if __name__ == "__main__":
    main()
