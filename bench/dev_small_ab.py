"""Dev probe: one small call with and without its host path's plans (#26), alternated.

``python3 -m bench.dev_small_ab [--rounds 6] [--repeats 60] [--sizes 64K,1M]
[--corpora bf16-relu,mixed] [--offload-timers]`` (GPU): per round, each op (``compress``,
``decompress(return_status=True)`` and their ``out=`` forms) of each corpus and size, timed as
``bench.latency`` times them (each call alone on an idle GPU: median host us, median CUDA-event
us end to end), once through the full path (``torch_pagecomp._small``'s plans and direct
decoder turned off) and once as shipped, the order alternating by round: a lent host's speed
drifts by tens of percent within a device call, so two runs apart compare nothing. Prints the
medians over rounds and the ratio.

``--offload-timers``: then where ``PageCompressor.offload`` + ``restore`` of a 1 MiB bf16 tensor
spends its host time, by function (``bench.dev_call_profile``'s timers).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import torch_pagecomp as pc
from bench.corpora import build_corpus, element_size
from bench.latency import human, parse_sizes, time_calls
from torch_pagecomp import _small

OFFLOAD_TARGETS = (
    "torch_pagecomp.module:PageCompressor.offload",
    "torch_pagecomp.module:PageCompressor.restore",
    "torch_pagecomp.handles:OffloadHandle.free",
    "torch_pagecomp._direct:DirectPath.offload",
    "torch_pagecomp._direct:DirectPath.restore_into",
    "torch_pagecomp._direct:DirectPath._bound",
    "torch_pagecomp._direct:DirectPath._drain",
    "torch_pagecomp._direct:DirectPath._settle",
    "torch_pagecomp._direct:DirectPath.free",
    "torch_pagecomp.offload._paged:PagedStore.offload",
    "torch_pagecomp.offload._paged:PagedStore._store_slice",
    "torch_pagecomp.offload._paged:PagedStore._compress_slice",
    "torch_pagecomp.offload._paged:PagedStore.restore",
    "torch_pagecomp.offload._paged:PagedStore.poll",
    "torch_pagecomp.offload._paged:PagedStore.free_after_restores",
    "torch_pagecomp._events:handoff",
    "torch_pagecomp.offload._streams:current_stream",
    "torch_pagecomp.kernels.launch:launch_known",
    "torch_pagecomp.kernels.launch:launch",
    "torch_pagecomp.module:_check_offloadable",
    "torch_pagecomp.module:_bytes_of",
    "torch_pagecomp.module:_not_capturing",
    "torch_pagecomp.handles:OffloadHandle.__init__",
    "torch_pagecomp.handles:RestoreFailures.add",
    "torch_pagecomp._direct:DirectPath._current",
    "torch_pagecomp.offload._paged:PagedStore._payload",
    "torch_pagecomp.offload._decode:decode_slice_at",
    "torch_pagecomp.offload._paged:_wait",
    "torch_pagecomp.offload._paged:copy_spans",
    "torch_pagecomp.offload._arena:VirtualArena.back",
    "torch_pagecomp.offload._arena:VirtualArena.confirm",
    "torch_pagecomp.offload._arena:VirtualArena.spans",
    "torch_pagecomp.offload._arena:VirtualArena.release",
    "torch_pagecomp.kernels.host_pack:pack_slice_at",
    "torch_pagecomp.kernels.exp_codec:compress_exp_placed_at",
    "torch_pagecomp.kernels.lz4_decompress:decode_rows_at",
    "torch:empty",
    "torch.cuda.streams:Event.record",
    "torch.cuda.streams:Event.query",
    "torch.cuda.streams:Stream.wait_event",
)


class _Full:
    """The full path: plans and the direct decoder off while entered."""

    def __enter__(self):
        self.saved = (_small.compress_plan, _small.direct_decoder)
        _small.compress_plan = lambda *a, **k: None
        _small.direct_decoder = lambda *a, **k: None

    def __exit__(self, *exc):
        _small.compress_plan, _small.direct_decoder = self.saved


def cases(corpus: str, nbytes: int, dev: torch.device) -> dict:
    """The four calls on ``nbytes`` of ``corpus``, as ``bench.latency`` makes them."""
    es = element_size(corpus)
    x = build_corpus(corpus, nbytes, 4096, dev, seed=1).view(-1, 4096)
    c = pc.compress(x, element_size=es)
    out_c = pc.compress(x, element_size=es)
    out_d = torch.empty_like(x)
    return {
        "compress": lambda: pc.compress(x, element_size=es),
        "decompress": lambda: pc.decompress(c, return_status=True),
        "compress_out": lambda: pc.compress(x, element_size=es, out=out_c),
        "decompress_out": lambda: pc.decompress(c, return_status=True, out=out_d),
    }


def parts(dev: torch.device, repeats: int) -> str:
    """Host us (median, idle GPU before each, as ``time_calls``) of the pieces a planned call
    of 1 MiB bf16-relu is made of."""
    x = build_corpus("bf16-relu", 1 << 20, 4096, dev, seed=1).view(-1, 4096)
    n = x.shape[0]
    c = pc.compress(x, element_size=2)
    pc.compress(x, element_size=2)
    plan = _small.compress_plan(x, None, 2, "lz4", "auto", False, None)
    from torch_pagecomp.kernels.lz4_compress import compress_scratch as scratch

    raw_alloc = torch._C._cuda_cudaCachingAllocator_raw_alloc
    raw_delete = torch._C._cuda_cudaCachingAllocator_raw_delete
    pages, status = _small.decode("lz4", c, None)
    kept = _small._DECODES[("lz4", n, 4096, x.get_device())]
    addrs = (c.payload.data_ptr(), None, c.sizes.data_ptr(), c.kinds.data_ptr(),
             pages.data_ptr(), status.data_ptr())
    pieces = {
        "torch.empty((n, P), uint8)": lambda: torch.empty((n, 4096), dtype=torch.uint8,
                                                          device=dev),
        "torch.empty(n, int32)": lambda: torch.empty((n,), dtype=torch.int32, device=dev),
        "x.new_empty((n, P))": lambda: x.new_empty((n, 4096)),
        "raw_alloc + raw_delete of (n, P)": lambda: raw_delete(raw_alloc(
            n * 4096, torch._C._cuda_getCurrentRawStream(x.get_device()))),
        "compress_scratch (one empty)": lambda: scratch(dev, plan.cfg, plan.programs,
                                                        kept_unused=True),
        "compress_plan (lookup and checks)": lambda: _small.compress_plan(
            x, None, 2, "lz4", "auto", False, None),
        "plan.run": lambda: plan.run(x, None),
        "direct_decoder": lambda: _small.direct_decoder(c, None, "auto"),
        "decode (2 allocations, 2 launches)": lambda: _small.decode("lz4", c, None),
        "kept decoder launches (2)": lambda: kept(addrs, (n * 4096,), None),
        "pc.compress": lambda: pc.compress(x, element_size=2),
        "pc.decompress(return_status=True)": lambda: pc.decompress(c, return_status=True),
    }
    lines = ["| piece (1 MiB bf16-relu) | host us |", "|---|---|"]
    for name, fn in pieces.items():
        h, _ = time_calls(fn, dev, repeats, 5, 0.5)
        lines.append(f"| {name} | {statistics.median(h) * 1e6:.1f} |")
    return "\n".join(lines)


def offload_timers(dev: torch.device, calls: int) -> str:
    """Host us by function of ``offload`` + ``restore`` + ``free`` of 1 MiB of bf16."""
    import time

    from bench.dev_call_profile import warm_cycle
    from bench.dev_hook_timing import TARGETS, instrument, timer_stats

    comp = pc.PageCompressor(device=dev)
    cycle = warm_cycle(comp, build_corpus("bf16-relu", 1 << 20, 4096, dev, seed=1)
                       .view(torch.bfloat16), 30)
    stats = timer_stats()
    undo = instrument(stats, tuple(dict.fromkeys(OFFLOAD_TARGETS + TARGETS)))
    total = 0
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            cycle()
            total += time.perf_counter_ns() - t0
    finally:
        for owner, attr, orig in reversed(undo):
            setattr(owner, attr, orig)
        comp.close()
    lines = [f"## offload + restore + free of 1 MiB bf16: {total / calls / 1e3:.1f} us a cycle "
             "with the timers (GPU idle before each)",
             "| function | calls a cycle | mean us a call (inclusive) | max us |",
             "|---|---|---|---|"]
    for fname, each in sorted(stats.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {fname} | {len(each) / calls:.1f} | {sum(each) / len(each) / 1e3:.1f} | "
                     f"{max(each) / 1e3:.0f} |")
    return "\n".join(lines)


def offload_tail(dev: torch.device, cycles: int) -> str:
    """Percentiles of the host time of ``offload``, ``restore`` and ``free`` of 1 MiB of bf16,
    each cycle on an idle GPU, no timers: what a caller meets call by call (a mean above the
    median is a few slow calls)."""
    import time

    comp = pc.PageCompressor(device=dev)
    t = build_corpus("bf16-relu", 1 << 20, 4096, dev, seed=1).view(torch.bfloat16)
    times: dict[str, list[float]] = {"offload": [], "restore": [], "free": []}
    try:
        for i in range(cycles + 30):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = comp.offload(t)
            t1 = time.perf_counter()
            comp.restore(h)
            t2 = time.perf_counter()
            h.free()
            t3 = time.perf_counter()
            if i >= 30:
                for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                    times[name].append(dt * 1e6)
    finally:
        comp.close()
    lines = [f"## host us per call over {cycles} cycles of 1 MiB bf16 (idle GPU before each)",
             "| call | p50 | p90 | p99 | max | mean |", "|---|---|---|---|---|---|"]
    for name, v in times.items():
        q = statistics.quantiles(v, n=100)
        lines.append(f"| {name} | {q[49]:.0f} | {q[89]:.0f} | {q[98]:.0f} | {max(v):.0f} | "
                     f"{statistics.fmean(v):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("64K,1M"))
    ap.add_argument("--corpora", default="bf16-relu,mixed")
    ap.add_argument("--offload-timers", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = {(corpus, size, op): fn for corpus in a.corpora.split(",") for size in a.sizes
            for op, fn in cases(corpus, size, dev).items()}
    host = {(key, arm): [] for key in rows for arm in ("full", "plan")}
    e2e = {(key, arm): [] for key in rows for arm in ("full", "plan")}
    for r in range(a.rounds):
        for arm in (("full", "plan") if r % 2 == 0 else ("plan", "full")):
            for key, fn in rows.items():
                if arm == "full":
                    with _Full():
                        h, e = time_calls(fn, dev, a.repeats, 5, 0.5)
                else:
                    h, e = time_calls(fn, dev, a.repeats, 5, 0.5)
                host[(key, arm)].append(statistics.median(h) * 1e6)
                e2e[(key, arm)].append(statistics.median(e) * 1e6)
    print(f"{a.rounds} alternated rounds, medians\n| corpus | size | op | full host us | "
          "plan host us | plan / full | full e2e us | plan e2e us |\n"
          "|---|---|---|---|---|---|---|---|")
    for key in rows:
        corpus, size, op = key
        fh, ph = (statistics.median(host[(key, arm)]) for arm in ("full", "plan"))
        fe, pe = (statistics.median(e2e[(key, arm)]) for arm in ("full", "plan"))
        print(f"| {corpus} | {human(size)} | {op} | {fh:.1f} | {ph:.1f} | {ph / fh:.2f} | "
              f"{fe:.1f} | {pe:.1f} |", flush=True)
    print(parts(dev, a.repeats))
    if a.offload_timers:
        print(offload_tail(dev, 1000))
        print(offload_timers(dev, 300))


if __name__ == "__main__":
    main()
