"""Dev profile of one training step with activation offload (GPU only): where the GPU's time goes.

``python3 -m bench.dev_training_profile [training_bench options] [--variant compressed_mem]
[--costs]``
builds the training bench's model and hooks, runs the warm-up steps, then profiles one step with
``torch.profiler`` (CUPTI: real kernel and copy durations, whatever the host threads did) and
prints per phase (forward / backward, split by a marker kernel): the span, the busy time
(union of intervals) of the model's kernels, of our compress / pack / decompress kernels, of the
copies each way, and how much of our kernels' time overlapped the model's. Then it compresses
the activations of one forward alone (no model running beside it, same batches) for the solo
kernel time: the in-step kernel time over the solo time is the interference. Between the
two: the profiled step's offload batches (mean kernel, download, kernel end -> download start,
gaps; host CPU per thread) and, with ``--costs``, calls, thread CPU and wall time of each host
function of the offload path.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch

from bench.training_bench import make_offloader, parse, setup

OURS = {"compress": r"_lz4_compress_kernel", "pack": r"pack_pages", "decompress": r"_decompress"}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(u: list, v: list) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        lo, hi = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        total += max(0.0, hi - lo)
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def classify(ev: dict) -> str:
    if ev.get("cat") == "gpu_memcpy":
        name = ev["name"]
        return "d2h" if "DtoH" in name else "h2d" if "HtoD" in name else "d2d"
    for kind, pat in OURS.items():
        if re.search(pat, ev["name"]):
            return kind
    return "marker" if "spin_kernel" in ev["name"] else "model"


def phases(trace: dict) -> None:
    evs = [e for e in trace["traceEvents"]
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    marks = [e["ts"] for e in evs if classify(e) == "marker"]
    split = marks[0] if marks else float("inf")
    for phase, keep in (("forward", lambda t: t < split), ("backward", lambda t: t >= split)):
        sel = [e for e in evs if keep(e["ts"])]
        if not sel:
            continue
        by: dict[str, list] = {}
        for e in sel:
            by.setdefault(classify(e), []).append((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3))
        t0 = min(a for v in by.values() for a, _ in v)
        t1 = max(b for v in by.values() for _, b in v)
        print(f"-- {phase}: span {t1 - t0:.1f} ms")
        model = union(by.get("model", []))
        for kind in ("model", "compress", "pack", "decompress", "d2h", "h2d"):
            iv = by.get(kind, [])
            if not iv:
                continue
            u = union(iv)
            durs = [b - a for a, b in iv]
            over = intersect(u, model) if kind != "model" else 0.0
            print(f"   {kind:<10} n {len(iv):5d}  sum {sum(durs):7.1f} ms  busy {length(u):7.1f} ms"
                  f"  median {statistics.median(durs) * 1e3:7.1f} us"
                  + (f"  beside model {over:6.1f} ms" if kind != "model" else ""))


def solo(model, x, batch_pages: int, page_size: int) -> None:
    """Compress one forward's saved activations with nothing else running."""
    from torch_pagecomp._ops import compress_eager, pack_eager
    from torch_pagecomp.offload_store import element_size_for

    params = {p.data_ptr() for p in model.parameters()}
    seen, saved = set(), []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        nbytes = t.untyped_storage().nbytes()
        if t.is_cuda and ptr not in params and ptr not in seen and nbytes >= 1 << 20:
            seen.add(ptr)
            saved.append((t.dtype, torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                t.untyped_storage())))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x)
    del loss
    step = batch_pages * page_size

    def run():
        for dtype, b in saved:
            es = element_size_for(dtype)
            for lo in range(0, b.numel() - b.numel() % page_size, step):
                pages = b[lo: lo + step].view(-1, page_size)
                payload, sizes, _ = compress_eager(pages, es)
                pack_eager(payload, sizes, zero_tail=False)

    run()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    run()
    e.record()
    e.synchronize()
    total = sum(b.numel() for _, b in saved)
    ms = s.elapsed_time(e)
    print(f"-- solo: {len(saved)} storages, {total / 2**30:.2f} GiB, compress + pack {ms:.1f} ms "
          f"= {total / ms / 1e6:.1f} GB/s (batches of {step >> 20} MiB)")


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of every live thread, by name (Linux)."""
    import threading

    out = {}
    for th in threading.enumerate():
        try:
            clk = time.pthread_getcpuclockid(th.ident)
            out[th.name] = out.get(th.name, 0.0) + time.clock_gettime(clk)
        except (OSError, AttributeError, TypeError):
            pass
    return out


def batches(comp, wall_ms: float, cpu0: dict, cpu1: dict) -> None:
    """The profiled step's offload batches: gaps between the stages, and host CPU per thread."""
    tl = sorted((t for t in comp.timeline() if t["kind"] == "offload"),
                key=lambda t: t["kernel"][0])
    if not tl:
        return
    n = len(tl)

    def mean(xs):
        xs = list(xs)
        return sum(xs) / max(1, len(xs))

    kern = mean(t["kernel"][1] - t["kernel"][0] for t in tl)
    down = mean(t["download"][1] - t["download"][0] for t in tl)
    issue = mean(t["download"][0] - t["kernel"][1] for t in tl)  # kernel end -> download start
    kgap = mean(b["kernel"][0] - a["kernel"][1] for a, b in zip(tl, tl[1:]))
    dl = sorted(tl, key=lambda t: t["download"][0])
    dgap = mean(max(0.0, b["download"][0] - a["download"][1]) for a, b in zip(dl, dl[1:]))
    span = tl[-1]["download"][1] - tl[0]["kernel"][0]
    print(f"-- {n} offload batches over {span:.1f} ms ({span / n:.2f} ms each): kernel "
          f"{kern:.2f}, download {down:.2f}, kernel end -> download start {issue:.2f}, "
          f"kernel stream gap {kgap:.2f}, link idle between downloads {dgap:.2f} ms (means)")
    print(f"-- host CPU ms over the step ({wall_ms:.0f} ms wall), per thread:")
    for name in sorted(cpu1, key=lambda k: -(cpu1[k] - cpu0.get(k, 0.0))):
        used = (cpu1[name] - cpu0.get(name, 0.0)) * 1e3
        if used >= 1:
            print(f"   {name:<28} {used:7.1f}")
    print("   first batches (ms from the first kernel; host times shifted alike):")
    g0 = tl[0]["kernel"][0]
    h0 = tl[0]["submitted"] - (tl[0]["kernel"][0] - g0)
    for t in tl[:12]:
        k, d = t["kernel"], t["download"]
        print(f"   sub {t['submitted'] - h0:7.2f} k {k[0] - g0:7.2f}-{k[1] - g0:7.2f} "
              f"iss {t['issued'] - h0:7.2f} d {d[0] - g0:7.2f}-{d[1] - g0:7.2f} "
              f"seen {t['noticed'] - h0:7.2f}")


COSTS: dict[str, list[float]] = {}  # "Class.method" -> [calls, thread CPU s, wall s]


def wrap_costs() -> None:
    """Count calls, thread CPU and wall time of the offload path's host functions."""
    import functools

    from torch_pagecomp import cuda_stages, module, offload_store, pipeline, pools, storage

    targets = [
        (offload_store.CompressedStore, "offload"), (module.PageCompressor, "offload"),
        (pipeline.Pipeline, "submit_compress"), (pipeline.Pipeline, "_submit_batch"),
        (pipeline.Pipeline, "acquire_slot"), (pools.InflightLimiter, "acquire"),
        (cuda_stages.CudaStages, "_enqueue_compress"), (pipeline.Pipeline, "_issue_download"),
        (pipeline.Pipeline, "_wait_download_room"), (pipeline.Pipeline, "_detach"),
        (pools.HostArena, "alloc"), (storage.Storage, "batch_stored"),
        (pipeline.Pipeline, "_complete"), (pipeline.Pipeline, "_finish"),
        (torch.cuda.Event, "synchronize"), (storage.Storage, "open_batch"),
    ]

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, **k):
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                row = COSTS.setdefault(label, [0, 0.0, 0.0])
                row[0] += 1
                row[1] += time.thread_time() - c0
                row[2] += time.perf_counter() - w0

        setattr(owner, name, timed)

    for owner, name in targets:
        wrap(owner, name, f"{owner.__name__}.{name}")
    for name in ("compress_eager", "pack_eager"):
        wrap(cuda_stages, name, name)


def main() -> None:
    argv = sys.argv[1:]
    costs = "--costs" in argv  # also time the offload path's host functions (wrap_costs)
    argv = [a for a in argv if a != "--costs"]
    if "--variant" not in argv:
        argv += ["--variant", "compressed_mem"]
    args = parse(argv)
    model, opt, x = setup(args)  # on args.device: cuda, the default
    off = make_offloader(args, model, args.variant) if args.variant != "none" else None

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x)
        torch.cuda._sleep(1000)  # the phase marker
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    if costs:
        wrap_costs()
    comp = next(iter(off._compressors.values()), None) if off is not None else None
    if comp is not None:
        comp.reset_timing()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        cpu0, t0 = thread_cpu(), time.perf_counter()
        step()
        torch.cuda.synchronize()
        cpu1, wall = thread_cpu(), (time.perf_counter() - t0) * 1e3
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    print(f"# {torch.cuda.get_device_name(0)} variant {args.variant} "
          f"priority {args.stream_priority}")
    phases(trace)
    if comp is not None:
        batches(comp, wall, cpu0, cpu1)
    if COSTS:
        print("-- host cost per function over the step: calls, thread CPU ms, wall ms")
        for label, (calls, cpu, wall_s) in sorted(COSTS.items(), key=lambda kv: -kv[1][1]):
            print(f"   {label:<34} {calls:5d} {cpu * 1e3:8.1f} {wall_s * 1e3:8.1f}")
    if off is not None:
        off.synchronize()
        off.remove()
    pages = comp.batch_pages if comp is not None else 16384
    solo(model, x, pages, args.page_size)


if __name__ == "__main__":
    main()
