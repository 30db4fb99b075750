"""CPU thread scaling of the lz4 path: compress and decompress GB/s at each thread count.

    python3 -m bench.cpu_threads [--mib 256] [--threads 1,2,4,8] [--out f.json]
                                 [--corpora mixed,text,bf16-relu] [--page-size 4096]
                                 [--host] [--procs] [--spans]

Each corpus (``bench/corpora.py``; typed ones at their element size, so ``bf16-relu`` is
bit-shuffled) is built once, ``--mib`` MiB of pages, then compressed and decompressed with
``torch_pagecomp.compress`` / ``decompress`` (``backend="cpu"``) at each thread count set with
``torch_pagecomp.set_cpu_threads``: the median of ``--repeats`` timed calls after one warm-up,
timed in rounds (each round one call at every thread count, so the host's drift is in every row).
GB/s are decimal, of uncompressed bytes; ``speedup`` is against the 1-thread row of the same
corpus and operation (1 is always measured), ``efficiency`` is ``speedup / threads`` (1.0 is
linear). Every round trip is checked bit-exact. The table goes to stdout, the JSON (``device``,
``commit``, ``date``, ``rows``, ...) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

import torch_pagecomp as pc
from torch_pagecomp import cpu_codec

from . import corpora
from .baselines import default_threads
from .harness import _cpu_name, commit_id

DEFAULT_CORPORA = ("mixed", "text", "bf16-relu")


def _ints(text: str) -> list[int]:
    values = sorted({int(t) for t in text.split(",") if t.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be integers >= 1, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in corpora.CORPORA]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(corpora.CORPORA)}")
    return names


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _in_rounds(groups: list, repeats: int) -> dict:
    """Median seconds of every call of ``groups`` (``(setup, {key: fn})``: ``setup()``, or
    nothing for None, then each ``fn`` timed once), the groups run in order ``repeats`` times
    over: a lent host's speed drifts by 20-30% within a minute
    (bench/results/h200_a1601c8_session29), and timed one group after another, the drift went
    into the comparison between groups."""
    times: dict = {key: [] for _, fns in groups for key in fns}
    for _ in range(repeats):
        for setup, fns in groups:
            if setup is not None:
                setup()
            for key, fn in fns.items():
                times[key].append(_median_s(fn, 1))
    return {key: statistics.median(v) for key, v in times.items()}


def _scale(rows: list[dict]) -> None:
    """Each row's ``speedup`` over the 1-thread row of its op, and ``efficiency`` (``speedup /
    threads``; 1.0 is linear)."""
    base = {r["op"]: r["gbps"] for r in rows if r["threads"] == 1}
    for r in rows:
        r["speedup"] = r["gbps"] / base[r["op"]]
        r["efficiency"] = r["speedup"] / r["threads"]


def measure(pages: torch.Tensor, element_size: int, threads: list[int], repeats: int) -> list[dict]:
    """Rows for one corpus: ``pages`` ``uint8 [N, P]`` (CPU) compressed and decompressed at each
    thread count, in ``repeats`` rounds of one call per op at every thread count
    (:func:`_in_rounds`), each row the median of its calls. Raises ``AssertionError`` if a
    round trip is not bit-exact."""
    counts = sorted(set(threads) | {1})
    nbytes = pages.numel()
    c = None
    calls = {
        "compress": lambda: pc.compress(pages, element_size=element_size, backend="cpu"),
        "decompress": lambda: pc.decompress(c, backend="cpu"),
    }
    try:
        for t in counts:  # warm-up: each thread count's first call, and the round trip checked
            pc.set_cpu_threads(t)
            c = pc.compress(pages, element_size=element_size, backend="cpu")
            assert torch.equal(pc.decompress(c, backend="cpu"), pages), f"round trip, {t} threads"
        seconds = _in_rounds([(lambda t=t: pc.set_cpu_threads(t),
                               {(op, t): call for op, call in calls.items()}) for t in counts],
                             repeats)
    finally:
        pc.set_cpu_threads(None)
    rows = [{"op": op, "threads": t, "seconds": s, "gbps": nbytes / s / 1e9, "ratio": c.ratio()}
            for (op, t), s in seconds.items()]
    _scale(rows)
    return [r for r in rows if r["threads"] in threads]


def host_reference(threads: list[int], repeats: int, mib: int = 32) -> list[dict]:
    """What this host's cores give any code at each thread count, as rows of the pseudo-corpus
    ``host``: ``copy`` (each thread copies its own ``mib`` MiB with numpy, GIL released: memory
    bandwidth) and ``sort`` (each thread sorts its own ``mib`` MiB of float64: compute, which
    shows the clock falling as cores wake up, and hyperthreads). GB/s of bytes handled; the
    codec's efficiency is read against these."""
    import numpy as np

    counts = sorted(set(threads) | {1})
    n = (mib << 20) // 8
    data = [np.random.default_rng(k).random(n) for k in range(max(counts))]
    dst = [np.empty_like(a) for a in data]
    for d in dst:
        d.fill(0)  # fault its pages in before timing

    def copy(k: int) -> None:
        for _ in range(4):
            np.copyto(dst[k], data[k])

    def sort(k: int) -> None:
        np.sort(data[k])

    ops = (("copy", copy, 4 * 2 * n * 8), ("sort", sort, n * 8))
    with ThreadPoolExecutor(max(counts)) as pool:  # in rounds, as ``measure``
        seconds = _in_rounds([(None, {(op, t): lambda fn=fn, t=t: list(pool.map(fn, range(t)))
                                      for op, fn, _ in ops for t in counts})], repeats)
    per_call = {op: b for op, _, b in ops}
    rows = [{"op": op, "threads": t, "seconds": s, "gbps": t * per_call[op] / s / 1e9,
             "ratio": None} for (op, t), s in seconds.items()]
    _scale(rows)
    return [{"corpus": "host", "element_size": 0, **r} for r in rows if r["threads"] in threads]


def _one_process(name: str, nbytes: int, page_size: int, seed: int, repeats: int, barrier,
                 results) -> None:
    """One process of :func:`process_reference`: its own copy of the corpus, one codec thread,
    both ops timed after every process is ready (``barrier``); puts ``(op, median seconds of
    a call, start, end)``, start and end on the host's monotonic clock (one clock for every
    process of the host)."""
    pc.set_cpu_threads(1)
    e = corpora.element_size(name)
    pages = corpora.build_corpus(name, nbytes, page_size, seed=seed)
    c = pc.compress(pages, element_size=e, backend="cpu")
    assert torch.equal(pc.decompress(c, backend="cpu"), pages), "round trip in a process"
    barrier.wait()
    for op, fn in (("compress", lambda: pc.compress(pages, element_size=e, backend="cpu")),
                   ("decompress", lambda: pc.decompress(c, backend="cpu"))):
        start = time.monotonic()
        median = _median_s(fn, repeats)
        results.put((op, median, start, time.monotonic()))
        barrier.wait()  # the next op starts together too


def process_reference(name: str, nbytes: int, page_size: int, counts: list[int], repeats: int,
                      seed: int) -> list[dict]:
    """The codec's work with no thread of ours shared: ``n`` processes at once, each compressing
    and decompressing its own copy of corpus ``name`` on one thread, as rows ``compress-procs``
    / ``decompress-procs`` (``threads``: processes). Where these scale no better than the
    threads do, the host is the limit (its clock, caches, memory), not the codec's threading.

    ``gbps``: every process's bytes over the span from the first process's start to the last
    one's end, as a threaded call is timed to its last range. ``gbps_sum_of_medians`` (what
    ``gbps`` was until the thirty-fifth session): the sum of each process's bytes over its own
    median call, which overstates the host: a process on a fast core finishes its calls
    early, and the slow ones then run their later calls with the machine less shared (a lent
    host's cores differ by up to 1.9x, bench/results/h200_eb9f4b0_session35)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh interpreter: no thread pools inherited
    rows = []
    for n in sorted(set(counts) | {1}):
        barrier, results = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_one_process, args=(name, nbytes, page_size, seed + k,
                                                        repeats, barrier, results))
                 for k in range(n)]
        for p in procs:
            p.start()
        got = [results.get(timeout=600) for _ in range(2 * n)]
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"a codec process exited with {p.exitcode}")
        for op in ("compress", "decompress"):
            mine = [g for g in got if g[0] == op]
            span = max(g[3] for g in mine) - min(g[2] for g in mine)
            rows.append({"op": f"{op}-procs", "threads": n, "seconds": span / repeats,
                         "gbps": n * repeats * nbytes / span / 1e9, "ratio": None,
                         "gbps_sum_of_medians": sum(nbytes / g[1] for g in mine) / 1e9})
    _scale(rows)
    return [r for r in rows if r["threads"] in counts]


def thread_spans(pages: torch.Tensor, element_size: int, threads: list[int],
                 repeats: int) -> list[dict]:
    """Where a threaded call's time goes (#25), medians over ``repeats`` calls per op and thread
    count, times from the start of ``cpu_codec._run_ranges``:

    - C loops that start their threads themselves (``_native.THREADS``; ``mode`` ``c``): one C
      call per batch. ``start_us``, when it began; ``tail_us``, from its end to the batch's;
      ``inflation``, the call's time times the threads over the one-thread call (above 1: the
      threads' start and join, and each thread's work slowing down: contention for the host's
      caches, memory or clock).
    - Python threads each making a C call (``mode`` ``python``): ``start_us``, when the last
      thread entered its C loop (the hand-off); ``tail_us``, from the first thread's end to the
      last's (what the threads wait for each other); ``inflation``, the threads' mean time in
      the loop times their number over the one-thread call."""
    c = pc.compress(pages, element_size=element_size, backend="cpu")
    calls = {"compress": lambda: pc.compress(pages, element_size=element_size, backend="cpu"),
             "decompress": lambda: pc.decompress(c, backend="cpu")}
    orig = cpu_codec._run_ranges
    spans: list[tuple] = []  # per batch: ([(start, end) of each C call], end of the batch)

    def timed(fn, n, page_size, c_loop=None):
        t0, got = time.perf_counter(), []

        def loop(counter, parts, threads):
            a = time.perf_counter() - t0
            c_loop(counter, parts, threads)
            got.append((a, time.perf_counter() - t0))

        orig(fn, n, page_size, loop if c_loop is not None else None)
        spans.append((got, time.perf_counter() - t0))

    mode = "c" if cpu_codec._C_THREADS else "python"
    rows = []
    try:
        cpu_codec._run_ranges = timed
        for op, call in calls.items():
            pc.set_cpu_threads(1)
            one = _median_s(call, repeats)
            for t in (t for t in threads if t > 1):
                pc.set_cpu_threads(t)
                call()  # warm-up
                spans.clear()
                for _ in range(repeats):
                    call()
                got = [g for g in spans if g[0]]
                if not got:
                    continue  # no C loops here (python-lz4): nothing to time
                if mode == "c":
                    start = [g[0][0][0] for g in got]
                    tail = [g[1] - g[0][0][1] for g in got]
                    busy = [(g[0][0][1] - g[0][0][0]) * t / one for g in got]
                else:
                    start = [max(a for a, _ in g[0]) for g in got]
                    tail = [max(b for _, b in g[0]) - min(b for _, b in g[0]) for g in got]
                    busy = [sum(b - a for a, b in g[0]) / one for g in got]
                rows.append({"op": op, "threads": t, "calls": len(got), "mode": mode,
                             "start_us": statistics.median(start) * 1e6,
                             "tail_us": statistics.median(tail) * 1e6,
                             "inflation": statistics.median(busy)})
    finally:
        cpu_codec._run_ranges = orig
        pc.set_cpu_threads(None)
    return rows


def run(mib: float, threads: list[int], names: list[str], page_size: int, repeats: int,
        seed: int, host: bool = False, procs: bool = False, spans: bool = False) -> dict:
    """Measure every corpus; returns the JSON document (see the module docstring)."""
    cores = default_threads()
    doc = {
        "device": f"CPU: {_cpu_name()} x{cores}",
        "cpu": _cpu_name(),
        "cores": cores,
        "commit": commit_id(None),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "page_size": page_size,
        "mib_per_corpus": mib,
        "repeats": repeats,
        "gbps": "decimal GB/s of uncompressed bytes, median of the timed calls",
        "loops": "C (_native)" if cpu_codec._native is not None else "python-lz4 page by page",
        "rows": [],
    }
    for k, name in enumerate(names):
        e = corpora.element_size(name)
        pages = corpora.build_corpus(name, int(mib * (1 << 20)), page_size, seed=seed + k)
        for row in measure(pages, e, threads, repeats):
            doc["rows"].append({"corpus": name, "element_size": e, **row})
        if spans:
            doc.setdefault("spans", []).extend(
                {"corpus": name, **r} for r in thread_spans(pages, e, threads, repeats))
        if procs:
            for row in process_reference(name, pages.numel(), page_size, threads, repeats,
                                         seed + k):
                doc["rows"].append({"corpus": name, "element_size": e, **row})
    if host:
        doc["rows"] += host_reference(threads, repeats)
    return doc


def table(doc: dict) -> str:
    lines = [f"{doc['device']}, commit {doc['commit']}, {doc['date']}, LZ4 loops: {doc['loops']}",
             f"{'corpus':<11} {'e':>1} {'op':<16} {'threads':>7} {'GB/s':>8} {'speedup':>8} "
             f"{'efficiency':>10}"]
    for r in doc["rows"]:
        lines.append(f"{r['corpus']:<11} {r['element_size']:>1} {r['op']:<16} {r['threads']:>7} "
                     f"{r['gbps']:>8.3f} {r['speedup']:>8.2f} {r['efficiency']:>10.2f}")
    if doc.get("spans"):
        lines.append(f"{'corpus':<11} {'op':<12} {'threads':>7} {'start us':>9} {'tail us':>8} "
                     f"{'inflation':>9} threads of")
        for r in doc["spans"]:
            lines.append(f"{r['corpus']:<11} {r['op']:<12} {r['threads']:>7} "
                         f"{r['start_us']:>9.0f} {r['tail_us']:>8.0f} {r['inflation']:>9.2f} "
                         f"{'the C call' if r['mode'] == 'c' else 'Python'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256, help="MiB of pages per corpus")
    parser.add_argument("--threads", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--corpora", type=_names, default=list(DEFAULT_CORPORA))
    parser.add_argument("--page-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--host", action="store_true",
                        help="also the host's own scaling: numpy copies and sorts per thread")
    parser.add_argument("--procs", action="store_true",
                        help="also each corpus in N processes at once, one thread each (the "
                             "host's limit for this very work, without our threads)")
    parser.add_argument("--spans", action="store_true",
                        help="also where a threaded call's time goes: hand-off, threads "
                             "waiting for each other, each thread's work slowing down")
    parser.add_argument("--python-lz4", action="store_true",
                        help="page by page through python-lz4, as without a C compiler")
    args = parser.parse_args(argv)
    if args.python_lz4:
        cpu_codec._native = None
    doc = run(args.mib, args.threads, args.corpora, args.page_size, max(1, args.repeats),
              args.seed, host=args.host, procs=args.procs, spans=args.spans)
    print(table(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
