"""Dev probe: one offload + restore through the kernel-only store; the hooks' host time.

``python3 -m bench.dev_paged_latency [--sizes 64K,1M,16M] [--repeats 100] [--profile-steps 6]``
(GPU). Two parts:

* For one bf16 tensor of each size (the ``bf16-relu`` corpus): ``PagedStore.offload`` then
  ``restore`` right away (the restore reads the chunk with kernels: the pack has not finished)
  and after the slice is placed (the copy engine), LZ4 and the exponent codec; host us of the
  two calls and end-to-end us (CUDA events), median over ``--repeats`` calls with the GPU idle
  before each; beside a pinned D2H + H2D copy of the same bytes. What
  ``PageCompressor.offload + restore`` would cost on that store (issue #26).
* cProfile over ``--profile-steps`` steps of the stock-model bench's encoder-1024 with the
  hooks' ``memory`` setting: functions by own time (issue #21: the host time per saved tensor).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.corpora import build_corpus
from bench.dev_host_profile import profile_calls
from bench.latency import human, parse_sizes


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples), 1)


def paged_rows(sizes: list[int], repeats: int) -> list[str]:
    from torch_pagecomp.offload._paged import PagedStore

    dev = torch.device("cuda")
    streams = tuple(torch.cuda.Stream(device=dev) for _ in range(3))
    store = PagedStore(dev, 4096, streams)
    lines = ["| size | codec | restore | host us offload + restore | e2e us | pinned copy e2e us |",
             "|---|---|---|---|---|---|"]
    for size in sizes:
        x = build_corpus("bf16-relu", size, 4096, dev, seed=1).reshape(-1)
        out = torch.empty_like(x)
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        copy = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            ev0.record()
            pinned.copy_(x, non_blocking=True)
            out.copy_(pinned, non_blocking=True)
            ev1.record()
            ev1.synchronize()
            copy.append(ev0.elapsed_time(ev1) * 1e3)
        for fmt in (None, "bf16"):
            for placed in (False, True):
                host, e2e = [], []
                for _ in range(repeats + 5):
                    torch.cuda.synchronize()
                    cur = torch.cuda.current_stream()
                    ev0.record()
                    t0 = time.perf_counter()
                    stored = store.offload(x, 2, cur, float_format=fmt)
                    t1 = time.perf_counter()
                    if placed:
                        torch.cuda.synchronize()
                        store.poll()
                    t2 = time.perf_counter()
                    store.restore(stored, out)
                    t3 = time.perf_counter()
                    ev1.record()
                    ev1.synchronize()
                    host.append((t1 - t0 + t3 - t2) * 1e6)
                    e2e.append(ev0.elapsed_time(ev1) * 1e3)
                    store.free(stored)
                if not torch.equal(out, x):
                    raise AssertionError(f"paged round trip differs ({human(size)}, {fmt})")
                e = "-" if placed else _median_us(e2e[5:])
                lines.append(f"| {human(size)} | {fmt or 'lz4'} | "
                             f"{'placed (copy engine)' if placed else 'at once (kernels)'} | "
                             f"{_median_us(host[5:])} | {e} | {_median_us(copy)} |")
    store.close()
    return lines


def profile_hooks(steps: int, model: str = "encoder-1024") -> str:
    from bench import stock_models
    from torch_pagecomp import offload_module

    net, x, blocks = stock_models.build(model, torch.device("cuda"))
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    off = offload_module(net, blocks=blocks, prefer="memory")

    def step():
        opt.zero_grad(set_to_none=True)
        net(x).float().square().mean().backward()
        opt.step()

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = profile_calls(step, steps, top=45, cumulative="torch_pagecomp")
    wall = (time.perf_counter() - t0) / steps * 1e3
    off.remove()
    return f"{model} memory: {wall:.1f} ms per step under cProfile, {steps} steps\n" + report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("64K,1M,16M"))
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--model", default="encoder-1024")
    a = ap.parse_args()
    print("== PagedStore offload + restore, one bf16 tensor, GPU idle before each")
    print("\n".join(paged_rows(a.sizes, a.repeats)))
    if a.profile_steps:
        print("== cProfile of the hooks")
        print(profile_hooks(a.profile_steps, a.model))


if __name__ == "__main__":
    main()
