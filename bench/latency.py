"""``python -m bench.latency``: the latency of ONE call, for small and mid-sized tensors.

For each corpus and size (the uncompressed bytes), these operations, each by up to three codecs:

* ``compress``: ``torch_pagecomp.compress`` of a ``uint8 [N, P]`` tensor (``element_size``
  of the corpus); nvCOMP's batched LZ4 (its bit-shuffle of that width for typed data) into
  preallocated buffers; a pinned device-to-host copy of the same bytes.
* ``decompress``: ``torch_pagecomp.decompress(c, return_status=True)`` of that output (the
  call that does not synchronise); nvCOMP's decompression of its output; a pinned host-to-
  device copy.
* ``compress_out`` / ``decompress_out`` (ours only): the same calls writing into tensors the
  caller keeps from call to call (``out=``), as nvCOMP's calls write into preallocated
  buffers: no output allocated per call.
* ``offload_restore``: ``PageCompressor.offload`` then ``restore`` back onto the GPU; nvCOMP
  compress, its sizes read on the host, the chunks gathered back to back, copied down to
  pinned memory and up again and decompressed from there; a pinned copy down and up.

Each timed call starts with the GPU idle (synchronised); the rows of one corpus and size take
turns (``--rounds``), so a drift in the host's speed falls on all of them. ``host_us`` is the
median host time until the call returns (``perf_counter``); ``e2e_us`` the median CUDA-event
time from before the call to the end of its work on the caller's stream. On the CPU
(``--device cpu``, no nvCOMP, copies are plain host copies) ``e2e_us`` is ``host_us``: a
smoke run for CI.

Prints a table and the verdicts on the targets (host time of a compress or decompress call
<= 30 us; a 1 MiB offload + restore end to end <= 2x its D2H + H2D pinned copy), and writes
``--out`` (JSON) with a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import torch_pagecomp as pc

from . import corpora, harness
from . import nvcomp as nvc
from .children import write_results

OPS = ("compress", "decompress", "compress_out", "decompress_out", "offload_restore")
OUT_OPS = ("compress_out", "decompress_out")  # ours only: the call into the caller's tensors
CODECS = ("pagecomp", "nvcomp", "copy")
DEFAULT_CORPORA = ("bf16-relu", "mixed")
HOST_TARGET_US = 30.0  # host time of one compress or decompress call
OFFLOAD_TARGET_BYTES = 1 << 20
OFFLOAD_TARGET_X = 2.0  # offload + restore end to end, over D2H + H2D of the same bytes
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def log(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[latency {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """``"64K"``, ``"1M"``, ``"1.5M"``, ``"4096"`` -> bytes (binary units, ``B``/``iB`` ok)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMG]?)(?:i?B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 64K, 1M, 16M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_sizes(text: str) -> list[int]:
    """A comma list of :func:`parse_size` sizes."""
    return [parse_size(t) for t in text.split(",") if t.strip()]


def human(nbytes: int) -> str:
    """``65536`` -> ``"64K"`` (whole binary units when exact)."""
    for unit in ("G", "M", "K"):
        if nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


# ----------------------------------------------------------------------- environment
def commit_id() -> str:
    """``$PAGECOMP_COMMIT``, else the checkout's ``HEAD`` (as the harness records it)."""
    return harness.commit_id(None)


def device_info(device: torch.device, nv_version: str | None) -> dict:
    """GPU (or CPU) name, driver, and the torch, Triton, CUDA and nvCOMP versions."""
    return {**harness.device_versions(device), "nvcomp": nv_version}


# ---------------------------------------------------------------------------- timing
def time_calls(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int,
    warmup: int,
    budget_s: float,
    after: Callable[[object], None] | None = None,
) -> tuple[list[float], list[float]]:
    """``(host_s, e2e_s)`` per call of ``fn``, each call alone on an idle GPU.

    ``warmup`` untimed calls first (kernels compile, pools fill), then up to ``repeats`` timed
    ones, fewer once the timed calls took ``budget_s``. ``after(result)`` runs after each call
    (untimed), e.g. to free what it made. On the CPU both lists are the host times.
    """
    cuda = device.type == "cuda"
    for _ in range(warmup):
        out = fn()
        if after is not None:
            after(out)
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
    host: list[float] = []
    e2e: list[float] = []
    while len(host) < max(1, repeats) and (not host or sum(e2e) < budget_s):
        if cuda:
            torch.cuda.synchronize(device)
            start.record()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        if cuda:
            end.record()
            end.synchronize()
            e2e.append(start.elapsed_time(end) / 1e3)
        else:
            e2e.append(t1 - t0)
        host.append(t1 - t0)
        if after is not None:
            after(out)
    if cuda:
        torch.cuda.synchronize(device)
    return host, e2e


# ------------------------------------------------------------------------ the calls
class NvcompOffload:
    """nvCOMP offload and restore of ``plan.pages`` at its simplest: compress, read the chunk
    sizes on the host (one wait, as any offload that stores exact sizes makes), gather the
    chunks back to back on the GPU, copy them to pinned memory and back, and decompress them
    from there into ``plan.result``."""

    def __init__(self, plan: nvc.LZ4Plan):
        self.plan = plan
        dev = plan.pages.device
        cap = plan.n * plan.stride
        self.host = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
        self.back = torch.empty(cap, dtype=torch.uint8, device=dev)
        self.rows = torch.arange(plan.n, device=dev)
        self.pos = torch.arange(cap, device=dev)
        self.ptrs: torch.Tensor | None = None
        self.stored = 0

    def __call__(self) -> None:
        plan = self.plan
        plan.compress()
        total = int(plan.sizes.sum())
        starts = torch.cumsum(plan.sizes, 0) - plan.sizes
        row = torch.repeat_interleave(self.rows, plan.sizes, output_size=total)
        packed = plan.out[row, self.pos[:total] - starts[row]]
        self.host[:total].copy_(packed, non_blocking=True)
        self.back[:total].copy_(self.host[:total], non_blocking=True)
        self.ptrs = starts + self.back.data_ptr()
        plan.decompress(self.ptrs)
        self.stored = total


@dataclass
class Case:
    """One row to time: ``fn`` is the call; ``after`` runs untimed after each; ``check``
    (after timing) returns whether a call's result is right and the row's extra fields known
    only then; ``extra`` goes in the row."""

    op: str
    codec: str
    fn: Callable[[], object]
    after: Callable[[object], None] | None = None
    check: Callable[[], bool | tuple[bool, dict]] | None = None
    extra: dict | None = None


def _copy_cases(flat: torch.Tensor, cuda: bool) -> list[Case]:
    """Plain copies of ``flat``'s bytes: down (for compress), up (for decompress), both."""
    if cuda:
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(flat)
        dev = torch.empty_like(flat)
        down = lambda: host.copy_(flat, non_blocking=True)
        up = lambda: dev.copy_(host, non_blocking=True)
        kind = "pinned"
    else:
        host, dev = torch.empty_like(flat), torch.empty_like(flat)
        down, up = (lambda: host.copy_(flat)), (lambda: dev.copy_(host))
        kind = "host memcpy"

    def both() -> None:
        down()
        up()

    return [
        Case("compress", "copy", down, extra={"call": f"{kind} D2H"}),
        Case("decompress", "copy", up, extra={"call": f"{kind} H2D"}),
        Case("offload_restore", "copy", both, check=lambda: torch.equal(dev, flat),
             extra={"call": f"{kind} D2H + H2D"}),
    ]


def _pagecomp_cases(pages: torch.Tensor, tensor: torch.Tensor, e: int,
                    comp: pc.PageCompressor) -> list[Case]:
    """Our compress and decompress calls on ``pages``; offload and restore of ``tensor`` (the
    same bytes, typed) through ``comp``."""
    c = pc.compress(pages, element_size=e)
    backend = pc.select_backend(pages.shape[0], pages.device)
    common = {"ratio": c.ratio(), "backend": backend}
    restored: list[torch.Tensor] = []
    c_out = pc.compress(pages, element_size=e)  # the caller's tensors, written by each call
    pages_out = torch.empty_like(pages)

    def compress_out_ok() -> bool:
        got = pc.compress(pages, element_size=e, out=c_out)
        return got.payload is c_out.payload and torch.equal(pc.decompress(got), pages)

    def decompress_out_ok() -> bool:
        pages_out.fill_(0xA5)
        got, status = pc.decompress(c, return_status=True, out=pages_out)
        return got is pages_out and bool((status == 0).all()) and torch.equal(got, pages)

    def compress_ok() -> bool:
        return torch.equal(pc.decompress(pc.compress(pages, element_size=e)), pages)

    def decompress_ok() -> bool:
        got, status = pc.decompress(c, return_status=True)
        return bool((status == 0).all()) and torch.equal(got, pages)

    def offload_restore() -> pc.OffloadHandle:
        h = comp.offload(tensor)
        restored[:] = [comp.restore(h)]  # kept past the timed call: its free is not timed
        return h

    def free(h: pc.OffloadHandle) -> None:
        restored.clear()
        h.free()
        comp.synchronize()

    def offload_ok() -> tuple[bool, dict]:
        h = comp.offload(tensor)
        ok = torch.equal(comp.restore(h, check=True).view(-1), tensor.view(-1))
        ratio = h.ratio  # stored bytes, page metadata included
        h.free()
        return ok, {"ratio": ratio}

    return [
        Case("compress", "pagecomp", lambda: pc.compress(pages, element_size=e),
             check=compress_ok,
             extra={**common, "call": f"torch_pagecomp.compress(pages, element_size={e})"}),
        Case("decompress", "pagecomp", lambda: pc.decompress(c, return_status=True),
             check=decompress_ok,
             extra={**common, "call": "torch_pagecomp.decompress(c, return_status=True)"}),
        Case("compress_out", "pagecomp", lambda: pc.compress(pages, element_size=e, out=c_out),
             check=compress_out_ok,
             extra={**common, "call": f"torch_pagecomp.compress(pages, element_size={e}, "
                                      "out=c)"}),
        Case("decompress_out", "pagecomp",
             lambda: pc.decompress(c, return_status=True, out=pages_out),
             check=decompress_out_ok,
             extra={**common, "call": "torch_pagecomp.decompress(c, return_status=True, "
                                      "out=pages)"}),
        Case("offload_restore", "pagecomp", offload_restore, after=free, check=offload_ok,
             extra={"backend": backend,
                    "call": f"PageCompressor.offload({tensor.dtype} tensor) + restore"}),
    ]


def _nvcomp_cases(nv: nvc.NvcompLib, pages: torch.Tensor, e: int) -> list[Case]:
    """nvCOMP's batched LZ4 on ``pages`` (bit-shuffled by width ``e`` when ``e > 1``), into
    buffers planned before timing as its API asks."""
    plan = nvc.LZ4Plan(nv, pages, e)
    plan.compress()
    ratio = pages.numel() / max(1, plan.stored_bytes())
    offload = NvcompOffload(nvc.LZ4Plan(nv, pages, e))
    bitshuffle = "none" if e == 1 else f"LSB-first, {8 * e}-bit"
    common = {"ratio": ratio, "nvcomp_version": nv.version, "bitshuffle": bitshuffle}

    def offload_ok() -> tuple[bool, dict]:
        offload()
        return offload.plan.roundtrip_ok(), {"ratio": pages.numel() / max(1, offload.stored)}

    return [
        Case("compress", "nvcomp", plan.compress, check=plan.compress_ok,
             extra={**common, "call": "nvcompBatchedLZ4CompressAsync"}),
        Case("decompress", "nvcomp", plan.decompress, check=plan.roundtrip_ok,
             extra={**common, "call": "nvcompBatchedLZ4DecompressAsync"}),
        Case("offload_restore", "nvcomp", offload, check=offload_ok,
             extra={**common, "call": "compress, sizes to host, gather, D2H + H2D, decompress"}),
    ]


# ------------------------------------------------------------------------------- run
@dataclass
class Config:
    """What to run (see :func:`parse_args`)."""

    sizes: list[int]
    corpora: list[str]
    device: str = "cuda"
    repeats: int = 200
    warmup: int = 5
    budget_s: float = 0.5
    rounds: int = 5
    page_size: int = 4096
    seed: int = 0


def run(cfg: Config) -> dict:
    """Time every (corpus, size, op, codec) row; returns the report dictionary."""
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    notes: list[str] = []
    nv = None
    if cuda:
        nv, why = nvc.load()
        if nv is None:
            notes.append(f"nvCOMP rows skipped: {why}")
    else:
        notes.append("CPU run: e2e_us = host_us, no nvCOMP rows, copies are host memcpy")
    for note in notes:
        log(note)
    comp = pc.PageCompressor(device=device, page_size=cfg.page_size)
    rows: list[dict] = []
    try:
        for ci, name in enumerate(cfg.corpora):
            e = corpora.element_size(name)
            for size in cfg.sizes:
                pages = corpora.build_corpus(name, size, cfg.page_size, device,
                                             seed=cfg.seed + ci)
                flat = pages.view(-1)
                tensor = flat.view({1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[e])
                cases = _pagecomp_cases(pages, tensor, e, comp)
                if nv is not None:
                    try:
                        cases += _nvcomp_cases(nv, pages, e)
                    except Exception as exc:  # noqa: BLE001 - the other rows stand alone
                        notes.append(f"nvCOMP rows skipped for {name} {human(size)}: "
                                     f"{type(exc).__name__}: {exc}")
                        log(notes[-1])
                cases += _copy_cases(flat, cuda)
                cases.sort(key=lambda k: (OPS.index(k.op), CODECS.index(k.codec)))
                rows += _time_cases(cases, name, e, pages.numel(), device, cfg)
                del cases, pages, flat, tensor
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        comp.close()
    report = {
        "device": device_info(device, nv.version if nv else None),
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"sizes": cfg.sizes, "corpora": cfg.corpora, "repeats": cfg.repeats,
                   "rounds": cfg.rounds,
                   "warmup": cfg.warmup, "budget_s_per_row": cfg.budget_s,
                   "page_size": cfg.page_size, "seed": cfg.seed, "device": str(device)},
        "timing": ("one call at a time on an idle GPU (synchronised before each), the rows of "
                   "a size in turns; host_us: "
                   "median perf_counter time until the call returns; e2e_us: median CUDA-event "
                   "time from before the call to the end of its work on the caller's stream"
                   if cuda else "one call at a time; host_us = e2e_us = median perf_counter"),
        "notes": notes,
        "rows": rows,
    }
    report["verdicts"] = verdicts(rows, cuda)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    return report


def _time_cases(cases: list[Case], corpus: str, e: int, nbytes: int, device: torch.device,
                cfg: Config) -> list[dict]:
    """Time each of ``cases`` on one corpus's ``nbytes`` and check its result: a row each.
    The cases take turns, ``cfg.rounds`` rounds of ``repeats / rounds`` calls each: the
    host's speed drifts within a run (twice as slow for a minute, seen on the H200's host,
    ``bench/results/h200_session84``), and rows timed one after another would compare
    different hosts."""
    rounds = max(1, min(cfg.rounds, cfg.repeats))
    times = [([], []) for _ in cases]
    for r in range(rounds):
        for case, (host, e2e) in zip(cases, times):
            h, t = time_calls(case.fn, device, cfg.repeats // rounds,
                              cfg.warmup if r == 0 else 1, cfg.budget_s / rounds, case.after)
            host += h
            e2e += t
    return [_row(case, host, e2e, corpus, e, nbytes) for case, (host, e2e) in zip(cases, times)]


def _row(case: Case, host: list[float], e2e: list[float], corpus: str, e: int,
         nbytes: int) -> dict:
    """One row: ``case``'s timings (seconds per call) and its checked result."""
    extra = dict(case.extra or {})
    ok = case.check() if case.check is not None else None
    if isinstance(ok, tuple):
        ok, more = ok
        extra.update(more)
    row = {
        "op": case.op,
        "codec": case.codec,
        "bytes": nbytes,
        "host_us": statistics.median(host) * 1e6,
        "e2e_us": statistics.median(e2e) * 1e6,
        "corpus": corpus,
        "element_size": e,
        "calls": len(host),
        "host_us_p90": _quantile(host, 0.9) * 1e6,
        "e2e_us_p90": _quantile(e2e, 0.9) * 1e6,
        "ok": ok,
        **extra,
    }
    log(f"{corpus:10s} {human(nbytes):>5s} {case.op:15s} {case.codec:8s} "
        f"host {row['host_us']:9.1f} us  e2e {row['e2e_us']:9.1f} us  ok={ok}")
    return row


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _find(rows: list[dict], **key) -> dict | None:
    """The first row whose fields equal ``key``'s."""
    for r in rows:
        if all(r.get(k) == v for k, v in key.items()):
            return r
    return None


def verdicts(rows: list[dict], cuda: bool) -> list[dict]:
    """Each target, per corpus and size it applies to: measured value, limit, pass (``None``
    where not judged: a CPU run, or the size not measured)."""
    out = []
    for r in rows:
        if r["codec"] == "pagecomp" and r["op"] in ("compress", "decompress") + OUT_OPS:
            out.append({"target": f"host time of one {r['op']} call <= {HOST_TARGET_US:g} us",
                        "corpus": r["corpus"], "bytes": r["bytes"], "value": r["host_us"],
                        "limit": HOST_TARGET_US, "pass": r["host_us"] <= HOST_TARGET_US})
    offload_target = (f"offload+restore of {human(OFFLOAD_TARGET_BYTES)} end to end "
                      f"<= {OFFLOAD_TARGET_X:g}x pinned D2H + H2D")
    judged = False
    for r in rows:
        key = (r["codec"], r["op"], r["bytes"])
        if key != ("pagecomp", "offload_restore", OFFLOAD_TARGET_BYTES):
            continue
        copy = _find(rows, op="offload_restore", codec="copy", corpus=r["corpus"],
                     bytes=r["bytes"])
        x = r["e2e_us"] / copy["e2e_us"] if copy and copy["e2e_us"] > 0 else float("inf")
        out.append({"target": offload_target, "corpus": r["corpus"], "bytes": r["bytes"],
                    "value": x, "limit": OFFLOAD_TARGET_X, "pass": x <= OFFLOAD_TARGET_X})
        judged = True
    if not judged:
        out.append({"target": offload_target, "corpus": None, "bytes": OFFLOAD_TARGET_BYTES,
                    "value": None, "limit": OFFLOAD_TARGET_X, "pass": None,
                    "note": f"not measured: add {human(OFFLOAD_TARGET_BYTES)} to --sizes"})
    if not cuda:  # measured and listed, but judged only on a GPU
        for v in out:
            v["pass"] = None
            v["note"] = "; ".join(filter(None, [v.get("note"), "CPU run: targets are for a GPU"]))
    return out


# ------------------------------------------------------------------------------ report
def format_table(report: dict) -> str:
    """Rows as a fixed-width table (``x copy``: e2e over the copy row of the same op), then
    the verdicts."""
    dev = report["device"]
    lines = [f"{dev['name']}  driver {dev['driver']}  torch {dev['torch']}  "
             f"triton {dev['triton']}  nvCOMP {dev['nvcomp']}  commit {report['commit']}  "
             f"{report['date']}", ""]
    lines += [f"note: {n}" for n in report["notes"]]
    head = (f"{'corpus':10s} {'size':>5s} {'op':15s} {'codec':8s} {'host us':>9s} "
            f"{'e2e us':>9s} {'x copy':>7s} {'ratio':>7s} {'ok':>5s}")
    lines += [head, "-" * len(head)]
    rows = report["rows"]
    last = None
    for r in rows:
        key = (r["corpus"], r["bytes"])
        if last is not None and key != last:
            lines.append("")
        last = key
        copy = _find(rows, op=r["op"].removesuffix("_out"), codec="copy", corpus=r["corpus"],
                     bytes=r["bytes"])
        x = f"{r['e2e_us'] / copy['e2e_us']:.2f}" if copy and copy["e2e_us"] > 0 else "-"
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
        lines.append(f"{r['corpus']:10s} {human(r['bytes']):>5s} {r['op']:15s} {r['codec']:8s} "
                     f"{r['host_us']:9.1f} {r['e2e_us']:9.1f} {x:>7s} {ratio:>7s} "
                     f"{str(r['ok']):>5s}")
    lines += ["", "verdicts:"]
    for v in report["verdicts"]:
        verdict = {True: "PASS", False: "FAIL", None: "----"}[v["pass"]]
        where = f"{v['corpus']} {human(v['bytes'])}" if v["corpus"] else ""
        value = "" if v["value"] is None else f"{v['value']:.2f}"
        note = f"  ({v['note']})" if v.get("note") else ""
        lines.append(f"  {verdict}  {v['target']:58s} {where:14s} {value:>9s}{note}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.latency",
        description="Latency of one compress, decompress and offload+restore call, beside "
        "nvCOMP (if installed) and a plain pinned copy of the same bytes.")
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("64K,1M,16M"),
                    help="uncompressed bytes per tensor, comma list (default 64K,1M,16M)")
    ap.add_argument("--corpora", default=",".join(DEFAULT_CORPORA),
                    help=f"comma list of bench corpora (default {','.join(DEFAULT_CORPORA)})")
    ap.add_argument("--repeats", type=int, default=200, help="timed calls per row (at most)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls per row first")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="stop a row's timed calls once they took this many seconds")
    ap.add_argument("--rounds", type=int, default=5,
                    help="the rows of a size take turns, this many rounds (host drift)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda[:i], cpu")
    ap.add_argument("--page-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0, help="corpus seed")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out",
                                                  "latency.json"),
                    help="JSON path; a Markdown table is written beside it (default "
                    "bench/out/latency.json)")
    args = ap.parse_args(argv)
    args.corpora = [c.strip() for c in args.corpora.split(",") if c.strip()]
    bad = [c for c in args.corpora if c not in corpora.CORPORA]
    if bad:
        ap.error(f"unknown corpora {bad}; choose from {', '.join(corpora.CORPORA)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.sizes or any(s < args.page_size for s in args.sizes):
        ap.error(f"every size must be at least one page ({args.page_size} bytes)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run, print the table and verdicts, write the JSON; exit 1 if a result was wrong."""
    args = parse_args(argv)
    cfg = Config(sizes=args.sizes, corpora=args.corpora, device=args.device,
                 repeats=args.repeats, warmup=args.warmup, budget_s=args.budget,
                 rounds=args.rounds,
                 page_size=args.page_size, seed=args.seed)
    report = run(cfg)
    report["command"] = "python -m bench.latency " + " ".join(sys.argv[1:] if argv is None
                                                               else argv)
    table = format_table(report)
    print(table)
    write_results(report, args.out, table)
    log(f"wrote {args.out} ({report['wall_s']} s)")
    bad = [f"{r['corpus']} {human(r['bytes'])} {r['op']} {r['codec']}" for r in report["rows"]
           if r["ok"] is False]
    if bad:
        log("WRONG RESULTS: " + "; ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
