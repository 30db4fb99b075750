"""Dev probe: where a ``PageCompressor`` offload's batches spend their time (#23).

``python3 -m bench.dev_pipeline_profile --corpora bf16-randn --codec auto --mib 1024`` (GPU):
per corpus, two warm offloads of ``--mib`` through the ring pipeline (as
``bench.pipeline_bench`` offloads it: ``--codec auto`` a 16-bit corpus as a bf16 tensor, so
the exponent codec), then one under ``torch.profiler`` (CPU + CUDA). Prints the GPU time of
each kernel and copy by name (count, total, mean), and the ring's compute stream batch by
batch: each kernel's issue time (the host's launch call) against its start on the GPU, both
from the offload's first launch, and its duration. Session 68's pipeline bench put the
exponent codec's kernel stage at 0.7-0.85 ms per 64 MiB batch (CUDA events), against about
0.1 ms for its kernels alone (``bench.dev_exp_encode``): this tells the GPU's time from the
host's.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import tempfile

import torch


def _events(prof) -> list[dict]:
    """The profile's Chrome-trace events (``ph == "X"``)."""
    path = os.path.join(tempfile.mkdtemp(), "trace.json.gz")
    prof.export_chrome_trace(path)
    with gzip.open(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def report(events: list[dict], batches: int) -> list[str]:
    """The per-name totals and the compute stream's first ``batches`` batches (see above)."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    calls = {e.get("args", {}).get("correlation"): e for e in events
             if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    by = collections.defaultdict(list)
    for e in gpu:
        by[e["name"][:60]].append(e["dur"])
    lines = ["| GPU work | count | total ms | mean us |", "|---|---|---|---|"]
    for name, durs in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {name} | {len(durs)} | {sum(durs) / 1e3:.2f} | "
                     f"{sum(durs) / len(durs):.1f} |")
    streams = collections.defaultdict(list)
    for e in gpu:
        if e["cat"] == "kernel":
            streams[e.get("args", {}).get("stream")].append(e)
    if not streams:
        return lines
    ks = sorted(max(streams.values(), key=len), key=lambda e: e["ts"])
    t0 = min(calls[c]["ts"] for c in (e.get("args", {}).get("correlation") for e in ks)
             if c in calls)
    lines += ["", "| compute-stream kernel | issued ms | start ms | dur us |", "|---|---|---|---|"]
    for e in ks[:batches * 4]:
        call = calls.get(e.get("args", {}).get("correlation"))
        issued = (call["ts"] - t0) / 1e3 if call is not None else float("nan")
        lines.append(f"| {e['name'][:40]} | {issued:.3f} | {(e['ts'] - t0) / 1e3:.3f} | "
                     f"{e['dur']:.1f} |")
    return lines


def offsets_table(counts: list[int], blocks: list[int], reps: int = 50) -> list[str]:
    """``--offsets``: a pack's page offsets (``kernels.pack.page_offsets``) by the one
    program at each ``OFFSETS_BLOCK`` of ``blocks``, and by PyTorch's kernels (zeros, clamp,
    cast, cumsum: its way past ``ONE_PROGRAM_PAGES``, and the only way before), for
    ``counts`` pages: GPU us a call (CUDA events around ``reps`` calls back to back) and host
    us a call."""
    import time

    from torch_pagecomp.kernels import pack

    def way(block: int | None):
        """``page_offsets`` with the one program at ``block`` sizes a step (None: PyTorch's)."""
        def offsets(sizes):
            saved = pack.OFFSETS_BLOCK, pack.ONE_PROGRAM_PAGES
            pack.OFFSETS_BLOCK = block or saved[0]
            pack.ONE_PROGRAM_PAGES = saved[1] if block else -1
            try:
                return pack.page_offsets(sizes, 4096, traced=False)
            finally:
                pack.OFFSETS_BLOCK, pack.ONE_PROGRAM_PAGES = saved
        return offsets

    ways = [("torch", way(None))] + [(f"one program, {b}", way(b)) for b in blocks]
    lines = ["| pages | way | GPU us | host us |", "|---|---|---|---|"]
    for n in counts:
        sizes = torch.randint(0, 4097, (n,), dtype=torch.int32, device="cuda")
        want = ways[0][1](sizes)
        for name, fn in ways:
            assert torch.equal(fn(sizes), want), name
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            for _ in range(reps):
                fn(sizes)
            b.record()
            host = (time.perf_counter() - t0) / reps * 1e6
            b.synchronize()
            lines.append(f"| {n} | {name} | {a.elapsed_time(b) / reps * 1e3:.1f} | {host:.1f} |")
    return lines


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from bench import corpora
    from bench.pipeline_bench import float_format
    from torch_pagecomp.module import PageCompressor

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpora", default="bf16-randn")
    ap.add_argument("--codec", choices=("auto", "lz4"), default="auto")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=6, help="batches of the timeline printed")
    ap.add_argument("--offsets", default=None, help="page counts: time the pack's offsets "
                    "(one program at --blocks, and PyTorch's way) instead")
    ap.add_argument("--blocks", default="1024,2048,4096")
    a = ap.parse_args()
    device = torch.device("cuda")
    if a.offsets:
        print("\n".join(offsets_table([int(n) for n in a.offsets.split(",")],
                                       [int(b) for b in a.blocks.split(",")])))
        return
    for name in a.corpora.split(","):
        pages = corpora.build_corpus(name, a.mib << 20, 4096, device, 1)
        fmt = float_format(name, a.codec)
        x = pages.view(torch.bfloat16) if fmt else pages
        es = corpora.element_size(name)
        with PageCompressor(device=device, codec=a.codec) as pc:
            for _ in range(2):
                pc.offload(x, element_size=es).wait()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                h = pc.offload(x, element_size=es)
                h.wait()
                torch.cuda.synchronize()
            print(f"## {name} ({'exp' if fmt else 'lz4'}), {a.mib} MiB, ratio "
                  f"{x.numel() * x.element_size() / h.stored_nbytes:.3f}")
            print("\n".join(report(_events(prof), a.batches)), flush=True)
            h.free()


if __name__ == "__main__":
    main()
