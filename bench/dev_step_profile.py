"""Dev probe: where one training step's host time goes under the activation-offload hooks.

``python3 -m bench.dev_step_profile --models encoder-1024,resnet-64 --variants uncompressed,memory``
(GPU): per model and variant, warm steps, the host issue time of plain steps (median), then
two steps under ``torch.profiler`` (CPU + CUDA): the host's blocking CUDA runtime calls
(synchronizations, allocations, pinning: count and ms per step), the top host ops by own
time, and the GPU's busy time per kind of work (the package's kernels, copies each way,
the model's kernels), and the first step's timeline (:func:`timeline`: when the host reaches
the backward, when the first restore copy is issued and runs, when the forward's bytes are all
on the host). ``--trace DIR`` also writes each profile as a Chrome trace (gzip).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import statistics
import tempfile
import time

PACKAGE_KERNELS = ("compress", "decompress", "pack", "fetch", "exp_", "checksum", "shuffle",
                   "lz4")


def _kind(name: str) -> str:
    low = name.lower()
    if "memcpy" in low and "dtoh" in low or "device -> pageable" in low:
        return "copy D2H"
    if "memcpy" in low and "htod" in low:
        return "copy H2D"
    if "memcpy" in low or "memset" in low:
        return "copy/set other"
    if low.startswith("_") and low.endswith("_kernel") and any(k in low for k in PACKAGE_KERNELS):
        return "pagecomp kernels"  # the package's Triton kernels (not PackedTensorAccessor)
    return "model kernels"


def timeline(events: list[dict]) -> list[str]:
    """The first profiled step's timeline from a Chrome trace's events (ms from the step's
    first host op): when the host reaches the backward (its first autograd function); the
    first host-to-device copy (when the host issued it, when the GPU ran it: a gap means it
    waited on the device, none that the link waited for the host); when the bytes the forward
    sent to the host were all there (the end of the last pack kernel or device-to-host copy
    issued before the backward); and that outbound work itself (:func:`_outbound`)."""
    ops = [e for e in events if e.get("ph") == "X"]
    host = [e for e in ops if e.get("cat") == "cpu_op"]
    if not host:
        return []
    t0 = min(e["ts"] for e in host)
    calls = {e.get("args", {}).get("correlation"): e for e in ops
             if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    backward = min((e["ts"] for e in host
                    if e["name"].startswith("autograd::engine::evaluate_function")), default=None)
    if backward is None:
        return []

    def issued(e):
        call = calls.get(e.get("args", {}).get("correlation"))
        return call["ts"] if call is not None else e["ts"]

    ms = lambda t: f"{(t - t0) / 1e3:.1f}"  # noqa: E731
    gpu = [e for e in ops if e.get("cat") in ("kernel", "gpu_memcpy")]
    h2d = sorted((e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]
                  and e["ts"] >= backward), key=lambda e: e["ts"])
    out = [e for e in gpu if issued(e) < backward
           and (("DtoH" in e["name"] or "Device -> P" in e["name"]) if e["cat"] == "gpu_memcpy"
                else "pack_slice" in e["name"])]
    lines = ["| first step's timeline | ms |", "|---|---|",
             f"| host reaches the backward | {ms(backward)} |"]
    lines += _compute_gaps(gpu, issued)
    if h2d:
        first = h2d[0]
        lines += [f"| first restore copy issued / run | {ms(issued(first))} / {ms(first['ts'])} |"]
    if out:
        lines += [f"| the forward's bytes all on the host | "
                  f"{ms(max(e['ts'] + e['dur'] for e in out))} |"]
        comp = [e for e in gpu if e["cat"] == "kernel" and issued(e) < backward
                and e["name"].startswith(COMPRESS_KERNELS)]
        lines += _outbound(out, comp, ms)
    return lines


def _busy_idle(events: list[dict], issued=None) -> tuple[float, float, float, float]:
    """``(busy, host late, device waits, span)`` in ms of ``events`` run one after another on
    one stream (sorted by start): the idle time between them split by cause, with ``issued``
    (an event's issue time): the next piece was issued after the previous one ended (the host
    late) or before (it waited on the device); without ``issued``, all of it device waits."""
    busy = sum(e["dur"] for e in events) / 1e3
    late_us = wait_us = 0.0
    end = events[0]["ts"]
    for e in events:
        gap = e["ts"] - end
        if gap > 0:
            late = min(gap, max(0.0, issued(e) - end)) if issued is not None else 0.0
            late_us += late
            wait_us += gap - late
        end = max(end, e["ts"] + e["dur"])
    return busy, late_us / 1e3, wait_us / 1e3, (end - events[0]["ts"]) / 1e3


def _compute_gaps(gpu: list[dict], issued) -> list[str]:
    """Rows on the compute stream (the stream with the most kernels): its busy time, and its
    idle time between kernels split by cause: the host issued the next kernel late (the host
    bounds the step there), or it was issued in time and waited on the device (an event: a
    restore, the in-flight bound)."""
    by_stream: dict = {}
    for e in gpu:
        if e["cat"] == "kernel":
            by_stream.setdefault(e.get("args", {}).get("stream"), []).append(e)
    if not by_stream:
        return []
    ks = sorted(max(by_stream.values(), key=len), key=lambda e: e["ts"])
    busy, host_late, device_wait, span = _busy_idle(ks, issued)
    return [f"| compute stream, both profiled steps: span / busy (kernels) | {span:.1f} / "
            f"{busy:.1f} ({len(ks)}) |",
            f"| compute stream idle: host late / device waits | {host_late:.1f} / "
            f"{device_wait:.1f} |"]


COMPRESS_KERNELS = ("_exp_encode_kernel", "_exp_encode_placed_kernel", "_lz4_compress_kernel")


def _outbound(out: list[dict], comp: list[dict], ms) -> list[str]:
    """Rows on the forward's outbound work ``out`` (pack kernels, or device-to-host copies:
    one stream, run one after another): when it started, its busy time, and the idle time
    between its pieces, with the compress kernels' time (``comp``) beside it. Where busy and
    idle fill the forward, that work bounds it; compress time close to the idle time says
    the compress ran between packs, not beside them (one payload: ``_paged.SCRATCH_SLICES``)."""
    out = sorted(out, key=lambda e: e["ts"])
    busy, _, idle, _ = _busy_idle(out)
    return [f"| outbound work (pack kernels or copies) starts | {ms(out[0]['ts'])} |",
            f"| outbound work busy / idle between its pieces | {busy:.1f} / {idle:.1f} |",
            f"| compress kernels of the forward, GPU time | "
            f"{sum(e['dur'] for e in comp) / 1e3:.1f} |"]


def measure(name: str, variant: str, steps: int, warmup: int, trace: str | None) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.dev_hook_timing import training_step

    step, off = training_step(name, variant)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    issue, total = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        issue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        total.append((time.perf_counter() - t0) * 1e3)
    prof_steps = 2
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_steps):
            step()
        torch.cuda.synchronize()
    lines = [f"## {name} {variant}: host issue {statistics.median(issue):.1f} ms, step to sync "
             f"{statistics.median(total):.1f} ms (medians of {steps})"]
    events = prof.key_averages()
    lines += ["| CUDA runtime call | calls / step | host ms / step |", "|---|---|---|"]
    api = [ev for ev in events if ev.key.startswith(("cuda", "cu"))]
    for ev in sorted(api, key=lambda e: -e.self_cpu_time_total)[:16]:
        lines.append(f"| {ev.key} | {ev.count / prof_steps:.0f} | "
                     f"{ev.self_cpu_time_total / prof_steps / 1e3:.2f} |")
    lines += ["| top host ops (own time) | calls / step | host ms / step |", "|---|---|---|"]
    shown = 0
    for ev in sorted(events, key=lambda e: -e.self_cpu_time_total):
        if ev.key.startswith(("cuda", "cu")):
            continue
        lines.append(f"| {ev.key[:60]} | {ev.count / prof_steps:.0f} | "
                     f"{ev.self_cpu_time_total / prof_steps / 1e3:.2f} |")
        shown += 1
        if shown == 15:
            break
    busy: dict[str, list] = {}
    for ev in events:
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0)
        if dev_us and ev.device_type == torch.autograd.DeviceType.CUDA:
            rec = busy.setdefault(_kind(ev.key), [0, 0.0])
            rec[0] += ev.count
            rec[1] += dev_us
    lines += ["| GPU work | launches / step | GPU ms / step |", "|---|---|---|"]
    for kind, (count, us) in sorted(busy.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {kind} | {count / prof_steps:.0f} | {us / prof_steps / 1e3:.2f} |")
    top = sorted((ev for ev in events if ev.device_type == torch.autograd.DeviceType.CUDA
                  and _kind(ev.key) == "pagecomp kernels"),
                 key=lambda e: -getattr(e, "self_device_time_total", 0))
    for ev in top[:6]:
        lines.append(f"|   {ev.key[:50]} | {ev.count / prof_steps:.0f} | "
                     f"{getattr(ev, 'self_device_time_total', 0) / prof_steps / 1e3:.2f} |")
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, f"{name}_{variant}.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            lines += timeline(json.load(f).get("traceEvents", []))
        if trace:
            os.makedirs(trace, exist_ok=True)
            with open(raw, "rb") as src, gzip.open(os.path.join(
                    trace, f"{name}_{variant}.json.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    if off is not None:
        off.remove()
    return "\n".join(lines)


def main() -> None:
    from bench.dev_hook_timing import stock_parser

    ap = stock_parser("none,uncompressed,memory")
    ap.add_argument("--trace", default=None)
    a = ap.parse_args()
    for name in a.models.split(","):
        for variant in a.variants.split(","):
            print(measure(name, variant, a.steps, a.warmup, a.trace), flush=True)


if __name__ == "__main__":
    main()
