"""Report: the terminal table, the JSON file and the PNG chart.

Run on its own to chart (and print) a saved run anywhere matplotlib is installed::

    python -m bench.report bench/out/results.json --png bench/out/results.png

JSON shape: header fields (``device``, ``driver``, ``torch``, ``triton``, ``commit``, ``date``,
``page_size``, ...), ``results`` (one row per corpus, codec and element size: ``corpus``,
``codec`` in ``pagecomp | nvcomp | lz4-cpu | lz4-cpu-mt | zipnn``, ``element_size`` (the
width the codec was told: pagecomp's ``element_size``, nvCOMP's bit-shuffle width or data type
width; 1 = plain bytes), ``corpus_element_size``, ``ratio``, ``compress_gbps``,
``decompress_gbps``, ``roundtrip_ok``, ``compress_host_us`` / ``decompress_host_us`` (GPU
codecs: host time to enqueue one call), ``skipped`` when the codec could not run (and why);
``"variant": "float"`` on the pagecomp row of the exponent codec, ``float_codec`` naming it,
``vs_typed`` on it (ours / each typed codec of that corpus); on bf16 corpora the typed nvCOMP
rows ``"variant": "ans-fp16-4k" | "ans-fp16-64k" | "bitcomp-4k"`` (``algorithm``,
``data_type``, ``chunk_bytes``, ``chunks``, ``options``) and the ZipNN rows ``"codec":
"zipnn"``, ``"variant": "bf16-256k" | "bf16-4k"`` (host CPU, ``threads``)), ``not_measured``
(codecs named but not run, with the reason) and ``copies`` (copy ceilings, ``gbps`` one-way).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

HEADER_KEYS = ("device", "driver", "host_cpu", "torch", "triton", "python", "lz4", "nvcomp",
               "commit", "date", "page_size", "mib_per_corpus", "seed", "timing")


def _num(x, fmt: str | None = None) -> str:
    """``fmt`` or, for speeds, 3 significant digits below 100 and whole numbers above."""
    if x is None:
        return "-"
    if fmt is None:
        fmt = "{:.0f}" if x >= 100 else "{:.3g}"
    return fmt.format(x)


def format_table(report: dict) -> str:
    """The run as text: a header block, the codec table, the copy ceilings."""
    lines = [f"{k:15s} {report.get(k)}" for k in HEADER_KEYS if k in report]
    gs = report.get("gpu_status", {})
    lines.append(f"{'gpu path':15s} usable={gs.get('usable')} ({gs.get('reason')})")
    if report.get("complete") is False:
        lines.append("INCOMPLETE RUN: only the corpora below finished")
    if report.get("nvcomp_absent"):
        lines.append(f"{'nvcomp':15s} ABSENT: {report['nvcomp_absent']}")
    for name, why in (report.get("not_measured") or {}).items():
        lines.append(f"{name:15s} NOT MEASURED: {why}")
    head = (f"{'corpus':12s} {'codec':27s} {'ratio':>7s} {'comp GB/s':>10s} {'decomp GB/s':>11s}"
            f" {'vs nvCOMP c / d / ratio':>24s} {'host us c/d':>11s}  {'ok':4s} note")
    lines += ["", head, "-" * len(head)]
    last = None
    for r in report.get("results", []):
        if last is not None and r["corpus"] != last:
            lines.append("")
        last = r["corpus"]
        vs = r.get("vs_nvcomp")
        vs_s = (f"{vs['compress']:.2f}x / {vs['decompress']:.2f}x / {vs['ratio']:.3f}x"
                if vs else "")
        note = ("skipped: " + " ".join(r["skipped"].split())[:60]) if r.get("skipped") else ""
        if r.get("error"):
            note = "ERROR: " + " ".join(r["error"].split())[:120]
        if r["codec"] == "pagecomp" and "backend" in r:
            k = r.get("page_kinds", {})
            coded = "exp" if r.get("variant") == "float" else "lz4"
            note = (f"backend={r['backend']} "
                    f"raw/{coded}/fill={k.get('raw')}/{k.get(coded)}/{k.get('fill')}")
            if r.get("checksum_gbps"):
                cost = r["checksum_cost"]
                note += (f" checksum {r['checksum_gbps']:.0f} GB/s (+{cost['compress']:.0%} c,"
                         f" +{cost['decompress']:.0%} d)")
        if r["codec"] == "nvcomp" and "interop" in r:
            note = "interop " + ",".join(f"{k}={v}" for k, v in r["interop"].items()
                                         if isinstance(v, bool))
        elif r["codec"] == "nvcomp" and r.get("algorithm") and not r.get("error"):
            note = f"{r['algorithm']} {r.get('data_type')} {r['chunks']} chunks of " \
                   f"{r['chunk_bytes']} B"
        elif r["codec"] == "zipnn" and r.get("zipnn_version"):
            note = (f"zipnn {r['zipnn_version']} on the host CPU, {r.get('threads')} threads, "
                    f"{r['chunk_bytes']} B chunks")
        ok = "-" if r.get("roundtrip_ok") is None else ("yes" if r["roundtrip_ok"] else "NO")
        host = (f"{r['compress_host_us']:.0f}/{r['decompress_host_us']:.0f}"
                if r.get("compress_host_us") is not None else "")
        lines.append(
            f"{r['corpus']:12s} {r.get('label', r['codec']):27s} {_num(r['ratio'], '{:.3f}'):>7s}"
            f" {_num(r['compress_gbps']):>10s} {_num(r['decompress_gbps']):>11s} {vs_s:>24s}"
            f" {host:>11s}  {ok:4s} {note}"
        )
    lines += typed_summary(report)
    copies = report.get("copies") or []
    if copies:
        lines += ["", "copy ceilings (one-way GB/s):"]
        for c in copies:
            val = c.get("skipped") or f"{c['gbps']:.2f} GB/s"
            if "gbps_read_plus_write" in c:
                val += f" ({c['gbps_read_plus_write']:.1f} GB/s read+write)"
            lines.append(f"  {c['name']:12s} {val}")
    return "\n".join(lines)


def is_typed_row(r: dict) -> bool:
    """A row of the typed comparison on a float corpus (issue #23): our exponent codec and the
    codecs told the same element width (nvCOMP LZ4 + bit-shuffle, ANS, Bitcomp; ZipNN)."""
    e = r.get("corpus_element_size", 1)
    if e == 1 or r.get("element_size") != e:
        return False
    return (r["codec"] == "pagecomp" and r.get("variant") == "float") \
        or r["codec"] in ("nvcomp", "zipnn")


def typed_summary(report: dict) -> list[str]:
    """Issue #23's question in one block: per float corpus (columns), ratio and compress /
    decompress GB/s of our exponent codec and of each typed codec measured beside it (rows)."""
    rows = [r for r in report.get("results", []) if is_typed_row(r)]
    corpora = list(dict.fromkeys(r["corpus"] for r in rows if r["codec"] == "pagecomp"))
    if not corpora:
        return []
    rows = [r for r in rows if r["corpus"] in corpora]
    labels = list(dict.fromkeys(r.get("label", r["codec"]) for r in rows))
    cell = {(r["corpus"], r.get("label", r["codec"])): r for r in rows}
    width = 19

    def show(r: dict | None) -> str:
        if r is None:
            return ""
        if r.get("error"):
            return "ERROR"
        if r.get("ratio") is None:
            return "skipped"
        bad = "" if r.get("roundtrip_ok") else " NO"
        return (f"{r['ratio']:.3f} {_num(r['compress_gbps'])}/{_num(r['decompress_gbps'])}"
                + bad)

    out = ["", "typed codecs on the float corpora, side by side: ratio compress/decompress GB/s"
           " (the host CPU for zipnn)",
           f"{'codec':27s} " + " ".join(f"{c:>{width}s}" for c in corpora)]
    out.append("-" * len(out[-1]))
    for lab in labels:
        out.append(f"{lab:27s} " + " ".join(f"{show(cell.get((c, lab))):>{width}s}"
                                            for c in corpora))
    return out


def save_json(report: dict, path: str) -> None:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    with open(path, "w") as f:
        json.dump(clean(report), f, indent=1)
        f.write("\n")


def _series(row: dict) -> str:
    """Chart series: one colour per codec, typed variants (E > 1) apart from plain."""
    if row["codec"] in ("nvcomp", "zipnn") and row.get("variant"):
        return f"{row['codec']} {row['variant']}"
    name = {"nvcomp": "nvcomp lz4", "lz4-cpu-mt": "lz4-cpu threads"}.get(row["codec"],
                                                                        row["codec"])
    if row.get("variant") == "float":
        return name + " exponent codec"
    if row.get("element_size", 1) > 1:
        name += " + bitshuffle" if row["codec"] == "nvcomp" else " element_size=E"
    return name


def chart(report: dict, png: str) -> None:
    """Three panels per corpus, codecs side by side: compress GB/s, decompress GB/s (log
    scales, copy ceilings as lines), ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r.get("ratio")]
    corpora = list(dict.fromkeys(r["corpus"] for r in report["results"]))
    series = list(dict.fromkeys(_series(r) for r in rows))
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(series)}
    fig, axes = plt.subplots(3, 1, figsize=(max(10, 1.3 * len(corpora)), 13), sharex=True)
    panels = [("compress_gbps", "compress GB/s", True), ("decompress_gbps", "decompress GB/s",
              True), ("ratio", "ratio (uncompressed / stored)", False)]
    for ax, (key, title, log) in zip(axes, panels):
        for i, c in enumerate(corpora):
            here = [r for r in rows if r["corpus"] == c and r.get(key)]
            width = 0.8 / max(1, len(here))
            for j, r in enumerate(here):
                ax.bar(i - 0.4 + (j + 0.5) * width, r[key], width, color=colors[_series(r)])
        if log:
            ax.set_yscale("log")
            for k, cp in enumerate(report.get("copies") or []):
                if cp.get("gbps"):
                    ax.axhline(cp["gbps"], ls="--", lw=1, color=f"C{k + 6}")
                    x, ha = (len(corpora) - 0.5, "right") if k % 2 else (-0.5, "left")
                    ax.annotate(f"copy {cp['name']} {cp['gbps']:.0f} GB/s", (x, cp["gbps"]),
                                fontsize=7, ha=ha, va="bottom", color=f"C{k + 6}")
        else:
            ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
    handles = [matplotlib.patches.Patch(color=colors[s], label=s) for s in series]
    fig.legend(handles=handles, loc="upper center", ncol=min(4, len(series)), fontsize=9,
               bbox_to_anchor=(0.5, 0.965))
    axes[-1].set_xticks(range(len(corpora)))
    axes[-1].set_xticklabels(corpora, rotation=20)
    fig.suptitle(f"torch-pagecomp, {report.get('device')}, {report.get('page_size')}-byte pages,"
                 f" commit {str(report.get('commit'))[:24]}, {report.get('date')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report",
                                 description="Print and chart a saved benchmark run.")
    ap.add_argument("json", help="results JSON written by python -m bench")
    ap.add_argument("--png", help="write the chart here (needs matplotlib)")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        report = json.load(f)
    print(format_table(report))
    if args.png:
        chart(report, args.png)
        print(f"chart: {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
