"""Training-step benchmark of activation offload: a GPT-style model in bf16, one variant per
process (clean peak-memory counters, an OOM or a hang costs one row).

Variants: ``none`` (no offload), ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu(
pin_memory=True)``), ``uncompressed`` (our stream-overlapped pinned offload), ``compressed``
(ours, ``prefer="speed"``: PageCompressor pages with a per-class fallback when the ratio <
``--min-ratio``; the step tuner times compressed against copied steps during the warm-up and
keeps the faster, see ``torch_pagecomp.offload._tune``), ``compressed_mem`` (``prefer="memory"``:
every batch of a compressible class through the kernel, always) and, on request,
``compressed_all`` (also classes below the ratio floor). The warm-up must cover the tuner's
trials (2 warm-up passes, 2 pairs of passes per arm): 12 steps by default.
Losses of every step are kept: ``loss dev`` is the largest relative difference from ``none``
(flash attention's backward is not bit-deterministic, so tiny values are expected; corrupted
activations show as large ones or NaN). Per variant: step time
(median over ``--steps`` after ``--warmup``, CUDA events around forward + backward + optimizer),
peak GPU memory (``torch.cuda.max_memory_allocated`` over the timed steps), host bytes held at
the end of the forward (offloaded storage, compressed sizes for ours) and offloaded bytes.

    python -m bench.training_bench --out bench/results/training.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("none", "save_on_cpu", "uncompressed", "compressed", "compressed_mem")
EXTRA = ("compressed_all",)
GIB = 1 << 30


def build_model(args):
    import torch
    import torch.nn as nn

    from bench.tinygpt import Block

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block(args.d, args.heads) for _ in range(args.layers))
            self.lnf = nn.LayerNorm(args.d)

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return self.lnf(x).float().square().mean()

    torch.manual_seed(args.seed)
    model = GPT()
    for name, p in model.named_parameters():  # GPT-2 initialisation
        if name.endswith("weight") and p.dim() == 2:
            std = 0.02 / math.sqrt(2 * args.layers) if "proj" in name or "fc2" in name else 0.02
            nn.init.normal_(p, 0.0, std)
    return model.to(args.device).to(torch.bfloat16)


class CountingSaveOnCpu:
    """``save_on_cpu(pin_memory=True)`` that also counts the bytes it moves to the host."""

    def __init__(self):
        import torch

        self.inner = torch.autograd.graph.save_on_cpu(pin_memory=True)
        pack = self.inner.pack_hook
        self.bytes = 0

        def counting(t):
            self.bytes += t.numel() * t.element_size()
            return pack(t)

        self.inner.pack_hook = counting

    def __enter__(self):
        self.bytes = 0
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def setup(args):
    """The model, its optimizer and the input batch of a run: ``(model, opt, x)``."""
    import torch

    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator(device=args.device).manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.seq, args.d, device=args.device, dtype=torch.bfloat16,
                    generator=gen)
    return model, opt, x


def make_offloader(args, model, variant: str):
    """Our hooks on ``model`` for one of our variants (``uncompressed``, ``compressed``...)."""
    from torch_pagecomp.offload import offload_module

    keep = model.blocks[len(model.blocks) - args.gpu_blocks:] if args.gpu_blocks else ()
    return offload_module(
        model,
        keep=keep,
        mode="uncompressed" if variant == "uncompressed" else "compressed",
        prefetch=args.prefetch,
        max_in_flight_bytes=args.max_in_flight_mb << 20,
        min_offload_bytes=args.min_offload_kb << 10,
        group_bytes=None,
        min_ratio=0.0 if variant == "compressed_all" else args.min_ratio,
        prefer="speed" if variant == "compressed" else "memory",
        page_size=args.page_size,
        offload_cpu=args.device != "cuda",  # CPU smoke runs only
        stream_priority=args.stream_priority,
    )


def run_variant(args) -> dict:
    """One variant in this process; returns its row."""
    import contextlib

    import torch

    variant = args.variant
    model, opt, x = setup(args)
    cuda = args.device == "cuda"
    off, soc = None, None
    if variant in ("uncompressed", *VARIANTS[3:], *EXTRA):
        off = make_offloader(args, model, variant)
    elif variant == "save_on_cpu":
        soc = CountingSaveOnCpu()

    losses = []

    def step(measure_host: bool = False) -> dict:
        opt.zero_grad(set_to_none=True)
        with soc if soc is not None else contextlib.nullcontext():
            loss = model(x)
        losses.append(loss.detach())
        info = {}
        if measure_host:
            sync()
            if off is not None:
                off.synchronize()
                info["host_bytes"] = off.host_bytes()
                info["offloaded_bytes"] = sum(
                    e.nbytes for e in list(off._live) if e.stored is not None
                )
            else:
                info["host_bytes"] = info["offloaded_bytes"] = soc.bytes if soc else 0
        loss.backward()
        opt.step()
        return info

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    times = []
    for _ in range(args.steps):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    host = step(measure_host=True)
    sync()
    row = {
        "variant": variant,
        "step_ms_median": statistics.median(times),
        "step_ms": [round(t, 2) for t in times],
        "peak_gpu_bytes": peak,
        "peak_gpu_gib": peak / GIB,
        "base_gpu_bytes": base,
        "host_bytes": host["host_bytes"],
        "offloaded_bytes": host["offloaded_bytes"],
        "ratio": host["offloaded_bytes"] / host["host_bytes"] if host["host_bytes"] else None,
        "losses": [float(v) for v in losses],
    }
    if off is not None:
        st = off.stats()
        row["pinned_held_bytes"] = st["pinned_held_bytes"]
        row["policy"] = st["policy"]
        if "tuner" in st:
            row["tuner"] = st["tuner"]
        row["counters"] = {k: v for k, v in st.items() if isinstance(v, int)}
        comp = st.get("compressor", {})
        if comp:
            c = next(iter(comp.values()))
            row["compressor"] = c
            row["pinned_held_bytes"] += c.get("host_held_bytes", 0)
        pending = off.pending()
        row["pending_after_backward"] = pending
    return row


def header(args) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    from .harness import commit_id

    commit = commit_id(None)
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": commit or None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, "-m", "bench.training_bench", *sys.argv[1:]]),
        "config": {k: getattr(args, k) for k in (
            "layers", "d", "heads", "batch", "seq", "steps", "warmup", "prefetch", "gpu_blocks",
            "max_in_flight_mb", "min_offload_kb", "min_ratio", "page_size", "stream_priority")},
    }


def loss_deviation(row: dict, none: dict | None) -> float | None:
    """Largest relative difference of ``row``'s step losses from ``none``'s (NaN: inf)."""
    if none is None or "losses" not in row or len(row["losses"]) != len(none["losses"]):
        return None
    devs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(row["losses"], none["losses"])]
    return max((d if math.isfinite(d) else math.inf) for d in devs)


def table(rows: list[dict]) -> str:
    none = next((r for r in rows if r["variant"] == "none" and "error" not in r), None)
    lines = [
        f"{'variant':<16}{'step ms':>10}{'vs none':>9}{'peak GPU GiB':>14}"
        f"{'host GiB':>10}{'offl. GiB':>11}{'ratio':>7}{'loss dev':>10}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<16}  error: {r['error'][-200:]}")
            continue
        rel = f"{r['step_ms_median'] / none['step_ms_median']:.2f}x" if none else "-"
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
        dev = loss_deviation(r, none)
        dev = "-" if dev is None else f"{dev:.1e}"
        lines.append(
            f"{r['variant']:<16}{r['step_ms_median']:>10.1f}{rel:>9}{r['peak_gpu_gib']:>14.2f}"
            f"{r['host_bytes'] / GIB:>10.2f}{r['offloaded_bytes'] / GIB:>11.2f}{ratio:>7}"
            f"{dev:>10}"
        )
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=2048, help="model width")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=12,
                    help="untimed steps (prefer='speed' tunes in the first 11)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prefetch", type=int, default=1, help="groups (blocks) restored ahead")
    ap.add_argument("--gpu-blocks", type=int, default=0,
                    help="our variants keep the activations of the last N blocks on the GPU")
    ap.add_argument("--max-in-flight-mb", type=int, default=1024)
    ap.add_argument("--min-offload-kb", type=int, default=1024)
    ap.add_argument("--min-ratio", type=float, default=1.1)
    ap.add_argument("--page-size", type=int, default=4096)
    ap.add_argument("--stream-priority", type=int, default=0,
                    help="our side streams' CUDA priority (lower = higher)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=150, help="seconds per variant")
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: smoke run")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # child process
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.variant is not None:
        print("ROW " + json.dumps(run_variant(args)), flush=True)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("training_bench needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    info = header(args)
    print(f"# {info['gpu']}  torch {info['torch']}  triton {info['triton']}  "
          f"commit {info['commit']}")
    print(f"# {info['config']}")
    rows = []
    child = [a for a in (argv if argv is not None else sys.argv[1:])]
    for variant in args.variants.split(","):
        cmd = [sys.executable, "-m", "bench.training_bench", *child, "--variant", variant]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                  env=dict(os.environ))
            out = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            row = json.loads(out[-1][4:]) if out else {
                "variant": variant, "error": (proc.stderr or proc.stdout)[-2000:]}
        except subprocess.TimeoutExpired:
            row = {"variant": variant, "error": f"timed out after {args.timeout} s"}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"# {variant}: {row.get('step_ms_median', row.get('error', '')[-300:])}",
              flush=True)
        if row.get("tuner"):
            print(f"# {variant} tuner: {json.dumps(row['tuner']['decisions'])}", flush=True)
    text = table(rows)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({**info, "rows": rows, "table": text}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
