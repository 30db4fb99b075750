"""``python -m bench``: ours against nvCOMP, python-lz4 and plain copies on the same pages.

Writes ``results.json``, ``table.txt`` and (when matplotlib imports) ``results.png`` under
``--out``; progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

from . import corpora, harness, report
from .timing import progress


def _list(choices):
    def parse(text: str) -> list[str]:
        if text == "all":
            return list(choices)
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in names if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return names

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="Compress the same pages with torch_pagecomp, nvCOMP batched LZ4 (if "
        "installed) and python-lz4; check round trips; time; write JSON, table and chart.",
    )
    ap.add_argument("--corpora", type=_list(corpora.CORPORA), default=list(corpora.CORPORA),
                    help=f"comma list or 'all' (default): {', '.join(corpora.CORPORA)}")
    ap.add_argument("--codecs", type=_list(harness.CODECS), default=list(harness.CODECS),
                    help=f"comma list or 'all' (default): {', '.join(harness.CODECS)}")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda[:i]")
    ap.add_argument("--mib", type=float, default=None,
                    help="MiB per corpus (default 128 on a GPU, 4 on the CPU)")
    ap.add_argument("--page-size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (max)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed runs first (default 2 on a GPU, 1 on the CPU)")
    ap.add_argument("--budget", type=float, default=None,
                    help="stop repeating once timed runs of one measurement took this many s "
                    "(default 10 on a GPU, 2 on the CPU)")
    ap.add_argument("--threads", type=int, default=harness.baselines.default_threads(),
                    help="threads for the lz4-cpu-mt baseline (default: all usable cores)")
    ap.add_argument("--verify-pages", type=int, default=0,
                    help="check this many random pages per row with lz4.block (0: all pages)")
    ap.add_argument("--pagecomp-backend", default="auto", choices=("auto", "cpu", "triton"),
                    help="backend= passed to torch_pagecomp.compress/decompress (default auto)")
    ap.add_argument("--seed", type=int, default=None, help="corpus seed (default: fresh)")
    ap.add_argument("--commit", default=None,
                    help="commit id for the header (default: $PAGECOMP_COMMIT or git)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"),
                    help="output directory (default bench/out/)")
    ap.add_argument("--no-png", action="store_true", help="skip the chart")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device.startswith("cuda")
    mib = args.mib if args.mib is not None else (128.0 if gpu else 4.0)
    warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    budget = args.budget if args.budget is not None else (10.0 if gpu else 2.0)
    cfg = harness.Config(
        corpora=args.corpora, codecs=args.codecs, device=device, mib=mib,
        page_size=args.page_size, repeats=args.repeats, warmup=warmup,
        budget_s=budget, seed=args.seed, threads=args.threads,
        verify_pages=args.verify_pages, commit=args.commit,
        pagecomp_backend=args.pagecomp_backend,
    )
    command = "python -m bench " + " ".join(shlex.quote(a) for a in (
        sys.argv[1:] if argv is None else argv))
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "results.json")
    rep = harness.run(cfg, lambda partial: report.save_json({**partial, "command": command},
                                                            json_path))
    rep["command"] = command
    report.save_json(rep, json_path)
    table = report.format_table(rep)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(table + "\n")
    print(table)
    progress(f"wrote {json_path}")
    if not args.no_png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            progress("matplotlib is not installed: no chart; run python -m bench.report "
                     f"{json_path} --png results.png where it is")
        else:
            png = os.path.join(args.out, "results.png")
            report.chart(rep, png)
            progress(f"wrote {png}")
    bad = [r["label"] + " on " + r["corpus"] for r in rep["results"]
           if r.get("roundtrip_ok") is False]
    interop = [r["label"] + " on " + r["corpus"] for r in rep["results"]
               if r.get("interop_ok") is False]
    if interop:
        progress("nvCOMP interop check failed (see interop in the JSON): " + "; ".join(interop))
    if bad:
        progress("FAILED (round trip or error): " + "; ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
