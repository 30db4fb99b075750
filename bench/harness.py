"""The benchmark run: every selected corpus through every selected codec, checked and timed.

:func:`run` returns the report dictionary that ``bench.report`` prints, saves and charts. One
row per (corpus, codec, element size), and on the 2-byte (bf16) corpora one more ``pagecomp``
row with ``"variant": "float"``: the exponent codec (``compress(..., codec="exp-bf16")``), and
beside it the typed codecs it is measured against (issue #23): nvCOMP ANS and Bitcomp rows
(``"codec": "nvcomp"``, ``"variant"`` a name of :func:`bench.nvcomp.typed_variants`, e.g.
``ans-fp16-4k``, ``ans-fp16-64k``, ``bitcomp-4k``), timed and checked like the nvCOMP LZ4 rows,
and ZipNN on the host CPU (``"codec": "zipnn"``) where ``import zipnn`` works. A codec that
cannot run here still gets its rows, with ``"skipped"`` saying why, so a report is always
complete; DFloat11 is named under ``"not_measured"`` with the reason.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import inspect
import os
import platform
import random
import subprocess
import time
import traceback
from dataclasses import dataclass, field

import lz4
import lz4.block
import torch

import torch_pagecomp as pc
from torch_pagecomp import format as fmt
from torch_pagecomp.exp_codec import decompress_exp_cpu
from torch_pagecomp.shuffle import bitshuffle

from . import baselines, corpora
from . import nvcomp as nvc
from .report import is_typed_row
from .timing import MAX_CALLS, WINDOW_S, gbps, host_seconds, measure, median, progress

CODECS = ("pagecomp", "nvcomp", "lz4-cpu", "lz4-cpu-mt", "zipnn", "copies")
# The exponent codec's row ("variant": "float") on corpora of this element size: every 2-byte
# corpus of bench.corpora holds bf16 values.
FLOAT_CODECS = {2: "exp-bf16"}
_VERIFY_CHUNK = 1024  # pages decoded with python-lz4 per step (bounds host memory)
# ZipNN (CPU, optional): bytearray_dtype per element size, and its chunk sizes measured: its
# default (256 KiB) and one page (the granularity of every other row)
ZIPNN_DTYPES = {2: "bfloat16"}
ZIPNN_CHUNKS = (256 * 1024, None)  # None: the page size
NOT_MEASURED = {
    "dfloat11": "its GPU decoder needs cupy and its own CUDA kernels, "
    "which are not carried to the GPU machine, and it compresses whole weight matrices "
    "offline (on the CPU) rather than pages",
}


@dataclass
class Config:
    """What to run. ``mib`` per corpus; ``verify_pages`` 0 checks every page with lz4.block."""

    corpora: list[str] = field(default_factory=lambda: list(corpora.CORPORA))
    codecs: list[str] = field(default_factory=lambda: list(CODECS))
    device: str = "cpu"
    mib: float = 4.0
    page_size: int = 4096
    repeats: int = 10
    warmup: int = 2
    budget_s: float = 10.0
    seed: int | None = None
    threads: int = field(default_factory=baselines.default_threads)
    verify_pages: int = 0
    commit: str | None = None
    pagecomp_backend: str = "auto"


# ----------------------------------------------------------------------- environment
def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def commit_id(explicit: str | None, root: str | None = None) -> str:
    """``--commit``, else ``$PAGECOMP_COMMIT``, else the tree's ``.commit`` file (a tree
    exported with ``git archive`` for the GPU machine names its commit there), else ``git
    rev-parse`` (+ ``-dirty``) where the tree is a checkout's top level; else ``"unknown"``.
    ``root``: the tree (default: the one this file is in). An exported tree inside another
    checkout once recorded that checkout's HEAD (``bench/results/h200_5b2a6fe_session30``)."""
    if explicit:
        return explicit
    if os.environ.get("PAGECOMP_COMMIT"):
        return os.environ["PAGECOMP_COMMIT"]
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(root, ".commit")) as f:
            return f.read().strip() or "unknown"
    except OSError:
        pass
    top = _run(["git", "-C", root, "rev-parse", "--show-toplevel"])
    if top is None or os.path.realpath(top) != os.path.realpath(root):
        return "unknown"
    head = _run(["git", "-C", root, "rev-parse", "HEAD"])
    if head is None:
        return "unknown"
    dirty = _run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"])
    return head + ("-dirty" if dirty else "")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_versions(device: torch.device) -> dict:
    """The device's name and driver, and the torch, CUDA, Triton and Python versions."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        driver = smi.splitlines()[0] if smi else "unknown"
    else:
        name, driver = f"CPU: {_cpu_name()}", "n/a"
    return {"name": name, "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version,
            "python": platform.python_version()}


def environment(device: torch.device, cfg: Config, nv_version: str | None) -> dict:
    v = device_versions(device)
    cuda = f" (torch CUDA {v['cuda']})" if device.type == "cuda" else ""
    status = pc.gpu_status()
    return {
        "device": v["name"],
        "driver": v["driver"] + cuda,
        "host_cpu": f"{_cpu_name()} x{baselines.default_threads()}",
        "torch": v["torch"],
        "triton": v["triton"],
        "python": v["python"],
        "lz4": lz4.__version__,
        "nvcomp": nv_version,
        "commit": commit_id(cfg.commit),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "page_size": cfg.page_size,
        "mib_per_corpus": cfg.mib,
        "seed": cfg.seed,
        "gpu_status": {"usable": status.usable, "reason": status.reason},
        "timing": (f"CUDA events, median of up to {cfg.repeats} windows of back-to-back calls "
                   f"(>= {WINDOW_S * 1e3:g} ms or {MAX_CALLS} calls) after {cfg.warmup} warm-up"
                   if device.type == "cuda" else
                   f"perf_counter, median of up to {cfg.repeats} runs after {cfg.warmup} warm-up")
                  + f", at most {cfg.budget_s:g} s of timed runs per measurement",
        "gbps": "decimal GB/s of uncompressed bytes",
        "ratio": "uncompressed bytes / stored payload bytes (metadata not counted)",
    }


# ---------------------------------------------------------------------------- checks
def _sample(n: int, verify_pages: int, gen: random.Random) -> list[int]:
    if verify_pages <= 0 or verify_pages >= n:
        return list(range(n))
    return sorted(gen.sample(range(n), verify_pages))


def _expected(pages: torch.Tensor, idx: torch.Tensor, element_size: int) -> torch.Tensor:
    """The bytes an LZ4 block of these pages must decode to (shuffled when E > 1), on CPU."""
    rows = pages[idx.to(pages.device)]
    return (bitshuffle(rows, element_size) if element_size > 1 else rows).cpu()


def check_pagecomp_blocks(c: pc.CompressedPages, pages: torch.Tensor, sample: list[int]):
    """Read our fixed-stride container with python-lz4 alone: ``(all_ok, pages_checked)``.

    LZ4 pages must decode with ``lz4.block`` to the (bit-shuffled, per the kind's high nibble)
    page; RAW pages must hold the page; FILL pages its one byte value.
    """
    p = c.page_size
    ok = True
    for lo in range(0, len(sample), _VERIFY_CHUNK):
        idx = torch.tensor(sample[lo : lo + _VERIFY_CHUNK], dtype=torch.int64)
        dev_idx = idx.to(c.device)
        payload = c.payload[dev_idx].cpu().numpy()
        sizes = c.sizes[dev_idx].tolist()
        kinds = c.kinds[dev_idx].tolist()
        orig = pages[idx.to(pages.device)].cpu().numpy()
        shifts = {k >> 4 for k, s in zip(kinds, sizes) if k & 15 == fmt.KIND_LZ4}
        shuffled = {s: _expected(pages, idx, 1 << s).numpy() for s in shifts if s}
        for j, (size, kind) in enumerate(zip(sizes, kinds)):
            codec, shift = kind & 15, kind >> 4
            if codec == fmt.KIND_FILL:
                ok &= size == 1 and bool((orig[j] == payload[j, 0]).all())
            elif codec == fmt.KIND_RAW:
                ok &= size == p and bytes(payload[j]) == bytes(orig[j])
            elif codec == fmt.KIND_LZ4:
                want = shuffled[shift][j] if shift else orig[j]
                try:
                    got = lz4.block.decompress(payload[j, :size].tobytes(), uncompressed_size=p)
                except Exception:  # noqa: BLE001 - lz4 raises a bare "corrupt input" error
                    got = b""
                ok &= 1 <= size < p and got == want.tobytes()
            else:
                ok = False
    return bool(ok), len(sample)


def check_exp_pages(c: pc.CompressedPages, pages: torch.Tensor, sample: list[int]):
    """Read an exponent-codec container's ``sample`` pages with the numpy reference decoder
    (``torch_pagecomp.exp_codec``), whatever decoded them in the run: ``(all_ok, checked)``."""
    p = c.page_size
    ok = True
    for lo in range(0, len(sample), _VERIFY_CHUNK):
        idx = torch.tensor(sample[lo : lo + _VERIFY_CHUNK], dtype=torch.int64)
        dev_idx = idx.to(c.device)
        payload = c.payload[dev_idx].cpu()
        offsets = torch.arange(idx.numel(), dtype=torch.int64) * p
        got, status = decompress_exp_cpu(payload.view(-1), offsets, c.sizes[dev_idx].cpu(),
                                         c.kinds[dev_idx].cpu(), p)
        ok &= not status.any() and torch.equal(got, pages[idx.to(pages.device)].cpu())
    return bool(ok), len(sample)


def nvcomp_interop(plan: nvc.LZ4Plan, pages: torch.Tensor, sample: list[int],
                   backend: str = "auto") -> dict:
    """Decode nvCOMP's RAW LZ4 blocks with python-lz4 and with our decoder (``backend``).

    A failure of our decoder is recorded (``pagecomp_decoder_error``), not raised: the nvCOMP
    row stands on its own.
    """
    p, width = plan.page_size, plan.bitshuffle_width
    decodes = matches_ours = True
    for lo in range(0, len(sample), _VERIFY_CHUNK):
        idx = torch.tensor(sample[lo : lo + _VERIFY_CHUNK], dtype=torch.int64)
        dev_idx = idx.to(plan.out.device)
        out = plan.out[dev_idx].cpu().numpy()
        sizes = plan.sizes[dev_idx].tolist()
        want = _expected(pages, idx, width).numpy()
        for j, size in enumerate(sizes):
            try:
                got = lz4.block.decompress(out[j, :size].tobytes(), uncompressed_size=p)
            except Exception:  # noqa: BLE001
                decodes = False
                continue
            matches_ours &= got == want[j].tobytes()
    result = {"pages_checked": len(sample), "python_lz4_decodes": bool(decodes)}
    if width > 1:
        result["bitshuffle_equals_pagecomp"] = bool(matches_ours)
    else:
        result["python_lz4_roundtrip"] = bool(decodes and matches_ours)
    if width > 1 and not matches_ours:
        result["pagecomp_decoder"] = "not tried: nvCOMP's bit-shuffle differs from ours"
        return result
    # Our container holds LZ4 pages of 1..P-P/32 bytes (a page that saves less is stored RAW);
    # nvCOMP's larger blocks are valid LZ4 but not pages of the format (status 2 there).
    fits = torch.nonzero(plan.sizes <= fmt.lz4_keep_limit(p)).flatten()
    result["pages_fitting_format"] = int(fits.numel())
    if fits.numel() == 0:
        return result
    sizes = plan.sizes[fits]
    rows = plan.out[fits]
    payload = rows[torch.arange(plan.stride, device=rows.device) < sizes[:, None]]
    offsets = torch.zeros(fits.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(sizes, 0, out=offsets[1:])
    kind = fmt.KIND_LZ4 | (fmt.element_shift(width) << 4)
    kinds = torch.full((fits.numel(),), kind, dtype=torch.uint8, device=rows.device)
    c = pc.CompressedPages(payload.contiguous(), sizes.to(torch.int32), kinds, p, offsets)
    try:
        got, status = pc.decompress(c, return_status=True, backend=backend)
        result["pagecomp_decoder_roundtrip"] = bool(
            (status == 0).all() and torch.equal(got, pages[fits.to(pages.device)])
        )
    except Exception as exc:  # noqa: BLE001
        result["pagecomp_decoder_roundtrip"] = False
        result["pagecomp_decoder_error"] = _describe(exc)
    return result


# ---------------------------------------------------------------------------- codecs
def _times(ctimes: list[float], dtimes: list[float], nbytes: int, comp, decomp, dev) -> dict:
    """Speeds from the timed windows, and on the GPU each call's host time to enqueue (µs)."""
    cuda = dev.type == "cuda"
    return {
        "compress_gbps": gbps(nbytes, median(ctimes)),
        "decompress_gbps": gbps(nbytes, median(dtimes)),
        "compress_s": ctimes,
        "decompress_s": dtimes,
        "compress_host_us": host_seconds(comp, dev) * 1e6 if cuda else None,
        "decompress_host_us": host_seconds(decomp, dev) * 1e6 if cuda else None,
    }


def bench_pagecomp(pages: torch.Tensor, element_size: int, cfg: Config, sample,
                   codec: str = "lz4") -> dict:
    """Our row: ``codec`` ``"lz4"`` (LZ4, bit-shuffled by ``element_size``) or an exponent
    codec (``"exp-bf16"``: the pages checked with the numpy reference decoder instead of
    python-lz4)."""
    dev = pages.device
    n, p = pages.shape
    be = cfg.pagecomp_backend
    backend = pc.select_backend(n, dev) if be == "auto" else be
    c = pc.compress(pages, element_size=element_size, backend=be, codec=codec)
    comp = lambda: pc.compress(pages, element_size=element_size, backend=be,  # noqa: E731
                               codec=codec)
    decomp = lambda: pc.decompress(c, return_status=True, backend=be)  # noqa: E731
    ctimes = measure(comp, dev, cfg.repeats, cfg.warmup, cfg.budget_s)
    dtimes = measure(decomp, dev, cfg.repeats, cfg.warmup, cfg.budget_s)
    # the page checksums (issue #20): what checksum=True adds to each direction (one more
    # pass over the uncompressed pages: after compress from the source, after decode)
    sums = lambda: pc.page_checksums(pages, backend=be)  # noqa: E731
    stimes = measure(sums, dev, cfg.repeats, cfg.warmup, cfg.budget_s)
    out, status = pc.decompress(c, return_status=True, backend=be)
    roundtrip = bool((status == 0).all()) and torch.equal(out, pages)
    if codec == "lz4":
        blocks_ok, checked = check_pagecomp_blocks(c, pages, sample)
        check, kinds = {"lz4_block_check": {"ok": blocks_ok, "pages_checked": checked}}, 3
    else:
        blocks_ok, checked = check_exp_pages(c, pages, sample)
        check, kinds = {"reference_check": {"ok": blocks_ok, "pages_checked": checked},
                        "float_codec": codec}, 4
    low = (c.kinds & 15).long()
    counts = torch.bincount(low, minlength=kinds).tolist()
    return {
        "ratio": c.ratio(),
        "stored_bytes": c.compressed_nbytes(),
        **_times(ctimes, dtimes, n * p, comp, decomp, dev),
        "checksum_gbps": gbps(n * p, median(stimes)),
        "checksum_cost": {"compress": median(stimes) / median(ctimes),
                          "decompress": median(stimes) / median(dtimes)},
        "roundtrip_ok": roundtrip and blocks_ok,
        "roundtrip_all_pages": roundtrip,
        **check,
        "page_kinds": {fmt.KIND_NAMES[k]: counts[k] for k in range(kinds)},
        "backend": backend,
        "backend_requested": be,
        "container": "fixed-stride",
    }


def _bench_plan(nv, plan, pages: torch.Tensor, cfg: Config) -> dict:
    """One nvCOMP plan timed and checked: compress, then decompress of what it wrote, on the
    current stream; the ratio counts the bytes of every chunk nvCOMP wrote (its sizes)."""
    dev = pages.device
    n, p = pages.shape
    ctimes = measure(plan.compress, dev, cfg.repeats, cfg.warmup, cfg.budget_s)
    compress_ok = plan.compress_ok()
    dtimes = measure(plan.decompress, dev, cfg.repeats, cfg.warmup, cfg.budget_s)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    stored = plan.stored_bytes()
    return {
        "ratio": n * p / max(1, stored),
        "stored_bytes": stored,
        **_times(ctimes, dtimes, n * p, plan.compress, plan.decompress, dev),
        "roundtrip_ok": compress_ok and plan.roundtrip_ok(),
        "compress_status_ok": compress_ok,
        "nvcomp_version": nv.version,
    }


def bench_nvcomp(nv, pages: torch.Tensor, width: int, cfg: Config, sample) -> dict:
    """nvCOMP LZ4 one chunk per page, bit-shuffled by ``width`` when it is above 1."""
    plan = nvc.LZ4Plan(nv, pages, width)
    row = {
        **_bench_plan(nv, plan, pages, cfg),
        "chunk_bytes": pages.shape[1],
        "bitshuffle": "none" if width == 1 else f"LSB-first, {8 * width}-bit unsigned",
        "interop": nvcomp_interop(plan, pages, sample, cfg.pagecomp_backend),
    }
    inter = row["interop"]
    row["interop_ok"] = all(v for k, v in inter.items() if isinstance(v, bool))
    del plan
    return row


def bench_nvcomp_typed(nv, pages: torch.Tensor, variant: nvc.Variant, cfg: Config) -> dict:
    """A typed nvCOMP codec (ANS, Bitcomp) on the same pages, timed exactly as the LZ4 rows;
    round trip bit-exact. :class:`bench.nvcomp.Unavailable` if this nvCOMP cannot run it."""
    plan = nvc.make_plan(nv, pages, variant)
    row = {**_bench_plan(nv, plan, pages, cfg), **plan.describe(), "about": variant.about}
    del plan
    return row


def zipnn_status() -> tuple[object | None, str]:
    """``(zipnn module, its version)`` when a ZipNN with typed byte grouping imports, else
    ``(None, why not)``."""
    try:
        import zipnn
    except Exception as exc:  # noqa: BLE001 - any import failure is "not installed" here
        return None, (f"zipnn is not installed ({type(exc).__name__}: {exc}); the current "
                      "zipnn has no binary wheel: build its sdist (C compiler, setuptools), "
                      "e.g. pip install --no-index --no-deps --no-build-isolation --target "
                      "/tmp/site .whl/optional/zipnn-0.5.4.tar.gz")
    try:
        version = importlib.metadata.version("zipnn")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(zipnn, "__version__", "unknown")
    params = inspect.signature(zipnn.ZipNN).parameters
    if not {"bytearray_dtype", "compression_chunk"} <= set(params):
        return None, (f"zipnn {version} has no bytearray_dtype / compression_chunk (no 2-byte "
                      "grouping before 0.2): not the ZipNN the literature measures")
    return zipnn, version


def bench_zipnn(zipnn, version: str, pages: torch.Tensor, element_size: int, chunk: int,
                cfg: Config) -> dict:
    """ZipNN on the host CPU over the same pages as one byte buffer, ``compression_chunk``
    ``chunk``, typed as its docs say for bf16 (``bytearray_dtype="bfloat16"``: byte grouping
    and its automatic method, Huffman for 16-bit types); threads: ZipNN's default.

    ZipNN's compress reorders its input buffer in place, so every timed call gets its own
    copy, made before the timing; the round trip is checked against an untouched copy.
    """
    cpu = torch.device("cpu")
    data = pages.cpu().contiguous().numpy().tobytes()
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPES[element_size],
                    compression_chunk=chunk)
    calls = cfg.warmup + max(1, cfg.repeats)
    bufs = [bytearray(data) for _ in range(calls)]
    comp = lambda: z.compress(bufs.pop())  # noqa: E731
    ctimes = measure(comp, cpu, cfg.repeats, cfg.warmup, cfg.budget_s)
    bufs.clear()
    c = bytes(z.compress(bytearray(data)))
    decomp = lambda: z.decompress(c)  # noqa: E731
    dtimes = measure(decomp, cpu, cfg.repeats, cfg.warmup, cfg.budget_s)
    out = z.decompress(c)
    return {
        "ratio": len(data) / max(1, len(c)),
        "stored_bytes": len(c),
        **_times(ctimes, dtimes, len(data), comp, decomp, cpu),
        "roundtrip_ok": bytes(out) == data,
        "zipnn_version": version,
        "threads": getattr(z, "threads", None),
        "chunk_bytes": chunk,
        "bytearray_dtype": ZIPNN_DTYPES[element_size],
        "method": "auto (its default)",
        "device_used": "host CPU",
    }


def _describe(exc: BaseException) -> str:
    """The exception and its root cause (a Triton CompilationError hides the reason there)."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = f"{type(exc).__name__}: {exc}"
    if root is not exc:
        text = f"{type(root).__name__}: {root} <- " + text
    return text[:2000]


def _skipped(corpus: str, codec: str, element_size: int, reason: str) -> dict:
    return {"corpus": corpus, "codec": codec, "element_size": element_size, "skipped": reason,
            "ratio": None, "compress_gbps": None, "decompress_gbps": None,
            "roundtrip_ok": None}


def label(row: dict) -> str:
    codec, e = row["codec"], row.get("element_size", 1)
    if codec == "pagecomp" and row.get("variant") == "float":
        return f"pagecomp {FLOAT_CODECS[e]}"
    if codec == "pagecomp":
        return "pagecomp" if e == 1 else f"pagecomp e={e}"
    if codec == "nvcomp" and row.get("variant"):
        return f"nvcomp {row['variant']}"
    if codec == "nvcomp":
        return "nvcomp lz4" if e == 1 else f"nvcomp lz4+bitshuffle{8 * e}"
    if codec == "zipnn":
        return f"zipnn {row['variant']} cpu" if row.get("variant") else "zipnn"
    if codec == "lz4-cpu-mt":
        return f"lz4-cpu x{row.get('threads', '?')}"
    return codec


def _nvcomp_match(rows: list[dict], corpus: str, e: int) -> dict | None:
    for row in rows:
        if (row["corpus"], row["codec"], row["element_size"]) == (corpus, "nvcomp", e) \
                and not row.get("variant"):
            return row if row.get("ratio") else None
    return None


def _versus(ours: dict, other: dict) -> dict:
    return {
        "against": label(other),
        "compress": ours["compress_gbps"] / other["compress_gbps"],
        "decompress": ours["decompress_gbps"] / other["decompress_gbps"],
        "ratio": ours["ratio"] / other["ratio"],
    }


def add_comparisons(results: list[dict]) -> None:
    """``vs_nvcomp`` on our rows: ours / nvCOMP LZ4 (same shuffle width) for speeds and ratio;
    on the exponent codec's rows also ``vs_typed``: ours / each measured typed codec (nvCOMP
    LZ4 + bit-shuffle, ANS, Bitcomp; ZipNN), keyed by its label."""
    for row in results:
        if row["codec"] != "pagecomp" or not row.get("ratio"):
            continue
        nv = _nvcomp_match(results, row["corpus"], row["element_size"])
        if nv is not None:
            row["vs_nvcomp"] = _versus(row, nv)
        if row.get("variant") == "float":
            row["vs_typed"] = {
                label(o): _versus(row, o) for o in results
                if o["corpus"] == row["corpus"] and o is not row and o.get("ratio")
                and o.get("compress_gbps") and is_typed_row(o)
            }



def corpus_rows(name: str, pages: torch.Tensor, cfg: Config, nv, nv_reason: str, sample):
    """Every selected codec on one corpus's pages: a list of rows."""
    e_corpus = corpora.element_size(name)
    widths = [1] if e_corpus == 1 else [1, e_corpus]
    jobs = []  # (codec, element size, variant or None, the job or why it is skipped)
    if "pagecomp" in cfg.codecs:
        jobs += [("pagecomp", e, None, lambda e=e: bench_pagecomp(pages, e, cfg, sample))
                 for e in widths]
        if e_corpus in FLOAT_CODECS:
            jobs.append(("pagecomp", e_corpus, "float", lambda: bench_pagecomp(
                pages, e_corpus, cfg, sample, codec=FLOAT_CODECS[e_corpus])))
    if "nvcomp" in cfg.codecs:
        jobs += [("nvcomp", e, None, (lambda e=e: bench_nvcomp(nv, pages, e, cfg, sample))
                  if nv else nv_reason) for e in widths]
        jobs += [("nvcomp", e_corpus, v.name,
                  (lambda v=v: bench_nvcomp_typed(nv, pages, v, cfg)) if nv else nv_reason)
                 for v in nvc.typed_variants(e_corpus, cfg.page_size)]
    if "zipnn" in cfg.codecs and e_corpus in ZIPNN_DTYPES:
        zn, info = zipnn_status()
        if zn is None:
            jobs.append(("zipnn", e_corpus, None, info))
        short = {"bfloat16": "bf16"}.get(ZIPNN_DTYPES[e_corpus], ZIPNN_DTYPES[e_corpus])
        for chunk in ZIPNN_CHUNKS if zn is not None else ():
            chunk = chunk or cfg.page_size
            jobs.append(("zipnn", e_corpus, f"{short}-{nvc.kib(chunk)}",
                         lambda c=chunk: bench_zipnn(zn, info, pages, e_corpus, c, cfg)))
    for codec, threads in (("lz4-cpu", 1), ("lz4-cpu-mt", cfg.threads)):
        if codec in cfg.codecs:
            jobs.append((codec, 1, None, lambda t=threads: baselines.lz4_cpu(
                pages, t, cfg.repeats, cfg.warmup, cfg.budget_s)))
    rows = []
    for codec, e, variant, job in jobs:
        if isinstance(job, str):
            row = _skipped(name, codec, e, job)
        else:
            try:
                row = {"corpus": name, "codec": codec, "element_size": e, **job()}
            except nvc.Unavailable as exc:  # this nvCOMP cannot run it: say why, go on
                row = _skipped(name, codec, e, str(exc))
                progress(f"  {name:12s} {codec} {variant or ''} unavailable: {exc}")
            except Exception as exc:  # noqa: BLE001 - report the failure, go on with the rest
                traceback.print_exc()
                row = _skipped(name, codec, e, "")
                del row["skipped"]
                row.update(error=_describe(exc), roundtrip_ok=False)
                progress(f"  {name:12s} {codec} {variant or ''} element_size={e} FAILED: "
                         f"{row['error'][:200]}")
        if variant is not None:
            row["variant"] = variant
        row["corpus_element_size"] = e_corpus
        row["pages"] = pages.shape[0]
        row["label"] = label(row)
        rows.append(row)
        if row.get("ratio") is not None:
            progress(f"  {name:12s} {row['label']:26s} ratio {row['ratio']:6.3f}  "
                     f"c {row['compress_gbps']:8.2f} GB/s  d {row['decompress_gbps']:8.2f}"
                     f" GB/s  ok={row['roundtrip_ok']}")
    return rows


# ------------------------------------------------------------------------------- run
def run(cfg: Config, checkpoint=None) -> dict:
    """Build each corpus on ``cfg.device`` and measure every selected codec on it.

    ``checkpoint(report)``, if given, is called with the partial report (``"complete":
    False``) after each corpus, so a run cut short still leaves its rows behind.
    """
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if cfg.seed is None:
        cfg.seed = random.randrange(1 << 31)
    nv, nv_reason = (None, "")
    if "nvcomp" in cfg.codecs:
        nv, nv_reason = nvc.load()
        if nv is None:
            progress(f"nvCOMP rows skipped: {nv_reason}")
        elif device.type != "cuda":
            nv_reason = f"nvCOMP {nv.version} found, but it needs a CUDA device"
            nv = None
    report = environment(device, cfg, nv.version if nv else None)
    if nv_reason:
        report["nvcomp_absent"] = nv_reason
    if any(corpora.element_size(c) in FLOAT_CODECS for c in cfg.corpora):
        report["not_measured"] = dict(NOT_MEASURED)
    nbytes = max(cfg.page_size, int(cfg.mib * (1 << 20)) // cfg.page_size * cfg.page_size)
    results: list[dict] = []
    rng = random.Random(cfg.seed)
    report["corpora"] = {}
    for ci, name in enumerate(cfg.corpora):
        progress(f"[{ci + 1}/{len(cfg.corpora)}] building {name} ({nbytes / 2**20:g} MiB)")
        t0 = time.perf_counter()
        pages = corpora.build_corpus(name, nbytes, cfg.page_size, device, seed=cfg.seed + ci)
        report["corpora"][name] = {
            "description": corpora.CORPORA[name].description,
            "element_size": corpora.element_size(name),
            "pages": pages.shape[0],
            "build_s": round(time.perf_counter() - t0, 3),
        }
        sample = _sample(pages.shape[0], cfg.verify_pages, rng)
        results += corpus_rows(name, pages, cfg, nv, nv_reason, sample)
        del pages
        if checkpoint is not None:
            checkpoint({**report, "results": results, "complete": False})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    add_comparisons(results)
    report["source_pools"] = corpora.pool_stats()
    report["results"] = results
    report["complete"] = True
    report["copies"] = []
    if "copies" in cfg.codecs:
        progress("copy baselines")
        report["copies"] = baselines.copies(nbytes, device, cfg.repeats, cfg.warmup,
                                            cfg.budget_s)
    return report
