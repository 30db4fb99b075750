"""Dev probe (#25): the CPU store of the activation hooks (``offload_cpu=True``) and of the KV
cache on a CPU: ``CpuStore.offload`` and ``restore`` of one tensor, by codec and size.

``python -m bench.dev_cpu_store TAG`` (CPU; torch on one thread, the codec's default
threads): ReLU activations in bf16 of 1 MiB and 32 MiB (and 32 MiB plus 1000 bytes: a partial
last page), LZ4 bit-shuffled by 2 bytes and the exponent codec; the median ms of 7 calls each
way after two untimed, every restore checked. Each line starts with TAG: run it once per tree
to compare trees.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from torch_pagecomp.offload._stores import CpuStore


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "run"
    torch.set_num_threads(1)
    store = CpuStore(compress=True)
    g = torch.Generator().manual_seed(1)
    for nbytes in (1 << 20, 32 << 20, (32 << 20) + 1000):
        x = torch.relu(torch.randn(nbytes // 2 + 1, generator=g)).to(torch.bfloat16)
        src = x.view(torch.uint8)[:nbytes]
        out = torch.empty_like(src)
        for ff in (None, "bf16"):
            offload, restore = [], []
            for i in range(9):
                t0 = time.perf_counter()
                s = store.offload(src, 2, ff)
                t1 = time.perf_counter()
                store.restore(s, out)
                t2 = time.perf_counter()
                if i >= 2:
                    offload.append(t1 - t0)
                    restore.append(t2 - t1)
                if not torch.equal(out, src):
                    raise AssertionError("the restore differs")
            print(f"{tag} {nbytes:9d} {ff or 'lz4':4s} offload "
                  f"{statistics.median(offload) * 1e3:7.2f} ms restore "
                  f"{statistics.median(restore) * 1e3:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
