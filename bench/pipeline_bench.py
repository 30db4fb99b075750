"""``python -m bench.pipeline_bench``: the offload pipeline end to end, against its floor and
against a plain pinned copy.

Per corpus (``--mib`` of pages on the device, default 1 GiB):

* offload: ``PageCompressor.offload`` until the handle is stored (wall time, host clock);
  restore: ``restore`` until the stream finished. Effective GB/s = uncompressed bytes / wall.
* floor: what a perfect pipeline reaches, ``min(kernel GB/s, pinned copy GB/s x ratio)``, from
  the kernels alone (compress + pack, or decompress, batch by batch on one stream) and a plain
  pinned copy of the same bytes, measured in the same run.
* baseline: ``tensor.to("cpu", non_blocking=True)`` (into pinned memory) and back; and nvCOMP
  plus copy at its best (``nv best``): ``min(nvCOMP kernel GB/s, pinned copy GB/s x nvCOMP's
  ratio)``, the floor of any nvCOMP + copy pipeline (its kernels timed batch by batch as ours).
* timeline: stage intervals of the last offload's batches, from CUDA events: a PNG when
  matplotlib imports, always in the JSON.
* codec: ``--codec auto`` (default) offloads a 16-bit corpus (bf16 values) as a bf16 tensor,
  so ``PageCompressor`` codes it as users get it, with the exponent codec, and the kernels'
  floor is the exponent codec's; ``--codec lz4`` offloads every corpus as bytes of
  ``element_size`` (LZ4, bit-shuffled: what this bench measured before session 68). nvCOMP's
  rows are its LZ4 (bit-shuffled) either way.

Writes ``pipeline_bench.json``, ``pipeline_bench.txt`` and ``timeline_<corpus>.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

import torch_pagecomp  # noqa: F401  (registers torch.ops.pagecomp)
from torch_pagecomp.backend import gpu_status
from torch_pagecomp.module import PageCompressor
from torch_pagecomp.timing import overlapping_slots

from .harness import commit_id

DEFAULT_CORPORA = ["mixed", "text", "binary", "bf16-randn", "random"]


def log(msg: str) -> None:
    print(f"[pipeline_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall(fn, device: torch.device, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` (which must end with its work finished), host clock."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# ------------------------------------------------------------------------- pieces
def float_format(name: str, codec: str) -> str | None:
    """The exponent codec's layout ``PageCompressor`` takes for corpus ``name`` offloaded as
    its values (``--codec auto``: the 16-bit corpora hold bf16), else None (LZ4)."""
    from . import corpora

    return "bf16" if codec == "auto" and corpora.element_size(name) == 2 else None


def kernel_rates(pages: torch.Tensor, es: int, bp: int, device, repeats: int,
                 fmt: str | None = None) -> tuple:
    """Compress+pack and decompress GB/s of the kernels alone, batch by batch, one stream
    (``fmt``: the exponent codec's kernels for that layout, else LZ4's)."""
    batches = [pages[i : i + bp] for i in range(0, pages.shape[0], bp)]
    packed = []
    ops = torch.ops.pagecomp

    def comp():
        packed.clear()
        for b in batches:
            payload, sizes, kinds = (ops.compress_exp(b, fmt) if fmt else ops.compress(b, es))
            buf, offsets = ops.pack(payload, sizes)
            packed.append((buf, offsets, sizes, kinds))

    decode = ops.decompress_exp if fmt else ops.decompress

    def decomp():
        for buf, offsets, sizes, kinds in packed:
            decode(buf, offsets[:-1], sizes, kinds, pages.shape[1])

    tc = statistics.median(wall(comp, device, repeats))
    td = statistics.median(wall(decomp, device, repeats))
    stored = sum(int(offsets[-1]) for _, offsets, _, _ in packed)
    packed.clear()
    return gbps(pages.numel(), tc), gbps(pages.numel(), td), pages.numel() / max(1, stored)


def offload_floor(kernel: float, link: float, ratio: float, raw_share: float) -> tuple:
    """The best offload rate (GB/s) with the kernel at ``kernel``, the link at ``link`` and the
    kernel's ratio ``ratio``, when a share of at most ``raw_share`` of the pages may go raw:
    the compressed share ``c`` minimises ``max(c / kernel, (c / ratio + 1 - c) / link)``.
    Returns ``(GB/s, "kernel" | "copy" | "split")``."""
    if kernel >= link * ratio or raw_share <= 0:
        return min(kernel, link * ratio), "kernel" if kernel < link * ratio else "copy"
    balanced = 1.0 / (link / kernel + 1.0 - 1.0 / ratio)  # kernel time = link time
    c = min(1.0, max(1.0 - raw_share, balanced))
    seconds = max(c / kernel, (c / ratio + 1.0 - c) / link)
    return 1.0 / seconds, "split" if c < 1.0 else "kernel"


def nvcomp_rates(pages: torch.Tensor, es: int, bp: int, device, repeats: int) -> dict:
    """nvCOMP batched LZ4 (its bit-shuffle of width ``es`` for typed corpora), batch by batch on
    one stream as :func:`kernel_rates`: kernel GB/s both ways and its ratio, from which the best
    an nvCOMP + copy pipeline could reach (its floor) follows. ``{}`` without nvCOMP."""
    if device.type != "cuda":
        return {}
    from . import nvcomp

    nv, why = nvcomp.load()
    if nv is None:
        log(f"nvCOMP unavailable: {why}")
        return {}
    plans = [nvcomp.LZ4Plan(nv, pages[i : i + bp], es) for i in range(0, pages.shape[0], bp)]
    tc = statistics.median(wall(lambda: [p.compress() for p in plans], device, repeats))
    td = statistics.median(wall(lambda: [p.decompress() for p in plans], device, repeats))
    stored = sum(p.stored_bytes() for p in plans)
    ok = all(p.compress_ok() and p.roundtrip_ok() for p in plans)
    n = pages.numel()
    return {"nvcomp_compress_gbps": gbps(n, tc), "nvcomp_decompress_gbps": gbps(n, td),
            "nvcomp_ratio": n / max(1, stored), "nvcomp_roundtrip_ok": ok}


def copy_rates(src: torch.Tensor, device, repeats: int) -> dict:
    """Plain copies of ``src``'s bytes: into preallocated pinned memory and back, and the
    ``.to("cpu", non_blocking=True)`` baseline (allocates its pinned output each call)."""
    n = src.numel()
    if device.type != "cuda":
        host = torch.empty_like(src)
        t = statistics.median(wall(lambda: host.copy_(src), device, repeats))
        return {"d2h_pinned_gbps": gbps(n, t), "h2d_pinned_gbps": gbps(n, t),
                "to_cpu_gbps": gbps(n, t), "to_device_gbps": gbps(n, t)}
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    flat = src.view(-1)
    back = torch.empty_like(flat)
    d2h = statistics.median(wall(lambda: pinned.copy_(flat, non_blocking=True), device, repeats))
    h2d = statistics.median(wall(lambda: back.copy_(pinned, non_blocking=True), device, repeats))
    held = []

    def to_cpu():
        held[:] = [flat.to("cpu", non_blocking=True)]

    base = statistics.median(wall(to_cpu, device, repeats))
    pinned_out = held[0].is_pinned()

    def to_dev():
        held.append(held[0].to(device, non_blocking=True))
        del held[1:]

    base_back = statistics.median(wall(to_dev, device, repeats))
    return {"d2h_pinned_gbps": gbps(n, d2h), "h2d_pinned_gbps": gbps(n, h2d),
            "to_cpu_gbps": gbps(n, base), "to_device_gbps": gbps(n, base_back),
            "to_cpu_output_pinned": pinned_out}


def pipeline_rates(pc: PageCompressor, x: torch.Tensor, es: int, device, repeats: int) -> dict:
    """Offload (until stored) and restore (until done) wall times through the module (``x``
    as the caller offloads it: bytes, or a bf16 tensor)."""
    n = x.numel() * x.element_size()
    handles = []

    def offload():
        for h in handles:
            h.free()
        handles[:] = [pc.offload(x, element_size=es)]
        handles[0].wait()

    def restore():
        handles.append(pc.restore(handles[0]))
        del handles[1:]

    t_off = wall(offload, device, repeats)
    pc.reset_timing()
    before = pc.stats()
    offload()  # the timeline of one offload, alone
    timeline = pc.timeline()
    stats = pc.stats()
    t_res = wall(restore, device, repeats)
    restored = pc.restore(handles[0], check=True)
    ok = bool(torch.equal(restored.view(torch.uint8).view(-1), x.view(torch.uint8).view(-1)))
    h = handles[0]
    row = {
        "offload_gbps": gbps(n, statistics.median(t_off)),
        "restore_gbps": gbps(n, statistics.median(t_res)),
        "offload_ms": [t * 1e3 for t in t_off],
        "restore_ms": [t * 1e3 for t in t_res],
        "ratio": n / max(1, h.stored_nbytes),
        "stored_nbytes": h.stored_nbytes,
        "stored_codec": h.codec,  # what the module chose ("exp" / "lz4")
        "bit_exact": ok,
        "bound_stage": stats["bound_stage"],
        "stage_ms": {k: stats[k] for k in ("upload_ms", "kernel_ms", "download_ms", "total_ms")},
        "batches": stats["batches"],
        "pinned_bytes_held": stats["pinned_bytes_held"],
        "bytes_held_host": stats["bytes_held_host"],
        "overlapping_stage_pairs": overlapping_slots(timeline),
        "raw_bypass_batches": stats["raw_bypass_batches"] - before["raw_bypass_batches"],
        "raw_split_batches": stats["raw_split_batches"] - before["raw_split_batches"],
        "timeline": timeline,
    }
    h.free()
    return row


def bench_corpus(name: str, args, device: torch.device) -> dict:
    from . import corpora

    es = corpora.element_size(name)
    nbytes = int(args.mib * (1 << 20))
    log(f"{name}: building {nbytes >> 20} MiB on {device}")
    pages = corpora.build_corpus(name, nbytes, args.page_size, device, args.seed)
    fmt = float_format(name, args.codec)
    pc = PageCompressor(device=device, page_size=args.page_size, batch_pages=args.batch_pages,
                        slots=args.slots, max_pinned_bytes=args.max_pinned_bytes,
                        raw_bypass=not args.no_raw_bypass, max_raw_share=args.max_raw_share,
                        codec=args.codec)
    row = {"corpus": name, "device": str(device), "element_size": es, "nbytes": pages.numel(),
           "codec": "exp" if fmt else "lz4", "batch_pages": pc.batch_pages, "slots": args.slots,
           "raw_bypass": not args.no_raw_bypass, "max_raw_share": args.max_raw_share}
    log(f"{name}: kernels alone ({row['codec']})")
    row["compress_kernel_gbps"], row["decompress_kernel_gbps"], row["kernel_ratio"] = (
        kernel_rates(pages, es, pc.batch_pages, device, args.repeats, fmt))
    log(f"{name}: nvCOMP kernels alone")
    try:
        row.update(nvcomp_rates(pages, es, pc.batch_pages, device, args.repeats))
    except Exception as exc:  # noqa: BLE001 - the baseline is optional
        log(f"{name}: nvCOMP failed: {exc!r}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log(f"{name}: plain copies")
    row.update(copy_rates(pages, device, args.repeats))
    log(f"{name}: pipeline")
    row.update(pipeline_rates(pc, pages.view(torch.bfloat16) if fmt else pages, es, device,
                              args.repeats))
    r = row["ratio"]
    row["offload_floor_gbps"], row["offload_floor_kind"] = offload_floor(
        row["compress_kernel_gbps"], row["d2h_pinned_gbps"], row["kernel_ratio"],
        args.max_raw_share)
    incompressible = row["raw_bypass_batches"] - row["raw_split_batches"]
    if incompressible * 2 >= row["batches"]:  # mostly raw copies: the copy's floor
        row["offload_floor_gbps"] = max(row["offload_floor_gbps"], row["d2h_pinned_gbps"])
        row["offload_floor_kind"] = "copy"
    row["restore_floor_gbps"] = min(row["decompress_kernel_gbps"], row["h2d_pinned_gbps"] * r)
    row["offload_vs_floor"] = row["offload_gbps"] / row["offload_floor_gbps"]
    row["restore_vs_floor"] = row["restore_gbps"] / row["restore_floor_gbps"]
    row["offload_vs_to_cpu"] = row["offload_gbps"] / row["to_cpu_gbps"]
    row["restore_vs_to_device"] = row["restore_gbps"] / row["to_device_gbps"]
    if "nvcomp_ratio" in row:  # nvCOMP + copy at best: its kernel or the link times its ratio
        nr = row["nvcomp_ratio"]
        row["nvcomp_offload_floor_gbps"] = min(row["nvcomp_compress_gbps"],
                                               row["d2h_pinned_gbps"] * nr)
        row["nvcomp_restore_floor_gbps"] = min(row["nvcomp_decompress_gbps"],
                                               row["h2d_pinned_gbps"] * nr)
        row["offload_vs_nvcomp_floor"] = row["offload_gbps"] / row["nvcomp_offload_floor_gbps"]
        row["restore_vs_nvcomp_floor"] = row["restore_gbps"] / row["nvcomp_restore_floor_gbps"]
    pc.empty_cache()
    del pages, pc
    return row


# ------------------------------------------------------------------------- output
COLUMNS = [
    ("corpus", "corpus", "{}"), ("codec", "codec", "{}"), ("ratio", "ratio", "{:.3f}"),
    ("compress_kernel_gbps", "kern GB/s", "{:.1f}"), ("d2h_pinned_gbps", "D2H GB/s", "{:.1f}"),
    ("offload_floor_gbps", "floor", "{:.1f}"), ("offload_floor_kind", "of", "{}"),
    ("offload_gbps", "offload", "{:.1f}"),
    ("offload_vs_floor", "/floor", "{:.2f}"), ("to_cpu_gbps", "to(cpu)", "{:.1f}"),
    ("offload_vs_to_cpu", "/to(cpu)", "{:.2f}"),
    ("nvcomp_offload_floor_gbps", "nv best", "{:.1f}"),
    ("offload_vs_nvcomp_floor", "/nv", "{:.2f}"),
    ("decompress_kernel_gbps", "dkern GB/s", "{:.1f}"), ("restore_floor_gbps", "floor", "{:.1f}"),
    ("restore_gbps", "restore", "{:.1f}"), ("restore_vs_floor", "/floor", "{:.2f}"),
    ("to_device_gbps", "to(dev)", "{:.1f}"), ("restore_vs_to_device", "/to(dev)", "{:.2f}"),
    ("nvcomp_restore_floor_gbps", "nv best", "{:.1f}"),
    ("restore_vs_nvcomp_floor", "/nv", "{:.2f}"),
    ("bit_exact", "exact", "{}"), ("overlapping_stage_pairs", "overlaps", "{}"),
]


def table(report: dict) -> str:
    head = [c[1] for c in COLUMNS]
    rows = [[fmt.format(r[k]) if k in r else "-" for k, _, fmt in COLUMNS]
            for r in report["results"]]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = [f"# {report['env']['device']} | commit {report['env'].get('commit')} | "
             f"torch {report['env']['torch']} | "
             f"{report['env']['date']} | {report['mib']} MiB per corpus, "
             f"{report['page_size']}-byte pages | GB/s = uncompressed bytes / wall time"]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    for r in report["results"]:
        lines.append(f"{r['corpus']}: offload batches bound by {r['bound_stage']}, "
                     f"stage sums {json.dumps({k: round(v, 2) for k, v in r['stage_ms'].items()})}"
                     f" ms, host held {r['bytes_held_host']} B, pinned {r['pinned_bytes_held']} B")
    return "\n".join(lines)


def timeline_png(row: dict, path: str, max_batches: int = 24) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no matplotlib: the JSON holds the timeline
        return False
    tl = row["timeline"][:max_batches]
    if not tl:
        return False
    t0 = min(t["upload"][0] for t in tl)
    colors = {"upload": "tab:blue", "kernel": "tab:orange", "download": "tab:green"}
    lanes = sorted({t["slot"] for t in tl})
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(lanes) * 3))
    for t in tl:
        for j, stage in enumerate(("upload", "kernel", "download")):
            a, b = t[stage]
            y = t["slot"] * 3 + j
            ax.broken_barh([(a - t0, max(b - a, 1e-3))], (y, 0.8), color=colors[stage])
    ax.set_yticks([s * 3 + j + 0.4 for s in lanes for j in range(3)])
    ax.set_yticklabels([f"slot {s} {st}" for s in lanes for st in ("up", "kernel", "down")])
    ax.set_xlabel("ms")
    clock = "CUDA events" if row.get("device", "").startswith("cuda") else "perf_counter"
    ax.set_title(f"{row['corpus']}: offload stages per slot ({clock}), "
                 f"{row['nbytes'] >> 20} MiB, ratio {row['ratio']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = None
    status = gpu_status()
    return {"device": name, "torch": torch.__version__, "triton": tv,
            "python": platform.python_version(), "cuda": torch.version.cuda,
            "gpu_path": status.reason, "commit": commit_id(None),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.pipeline_bench", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", default=",".join(DEFAULT_CORPORA),
                    help=f"comma list of bench.corpora names (default {','.join(DEFAULT_CORPORA)})")
    ap.add_argument("--mib", type=float, default=1024, help="MiB per corpus (default 1024)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--page-size", type=int, default=4096)
    ap.add_argument("--batch-pages", type=int, default=None, help="default: from the card")
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--max-pinned-bytes", type=int, default=None)
    ap.add_argument("--no-raw-bypass", action="store_true",
                    help="always run the kernel, even on incompressible streams")
    ap.add_argument("--max-raw-share", type=float, default=0.0,
                    help="share of batches that may go raw when the kernel is the bottleneck "
                    "(0: ratio first, default; 1: speed first)")
    ap.add_argument("--codec", choices=("auto", "lz4"), default="auto",
                    help="auto (default): 16-bit corpora offloaded as bf16 tensors, so the "
                    "exponent codec; lz4: every corpus as bytes (LZ4, bit-shuffled)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (median), after 1 warm-up")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default="bench/out/pipeline", help="output folder")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(args.out, exist_ok=True)
    report = {"env": environment(device), "mib": args.mib, "page_size": args.page_size,
              "argv": sys.argv, "results": []}
    for name in [c for c in args.corpora.split(",") if c]:
        try:
            row = bench_corpus(name, args, device)
        except Exception as exc:  # noqa: BLE001 - keep the other corpora
            log(f"{name}: failed: {exc!r}")
            report["results"].append({"corpus": name, "error": repr(exc)})
            continue
        row["timeline_png"] = (os.path.join(args.out, f"timeline_{name}.png")
                               if timeline_png(row, os.path.join(args.out, f"timeline_{name}.png"))
                               else None)
        report["results"].append(row)
        with open(os.path.join(args.out, "pipeline_bench.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
    ok = [r for r in report["results"] if "error" not in r]
    text = table({**report, "results": ok})
    with open(os.path.join(args.out, "pipeline_bench.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if len(ok) == len(report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
