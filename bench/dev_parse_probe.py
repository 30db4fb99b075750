"""Dev probe for the compressor's parse options (``lazy``, ``min_match``, ``skip``, ``back``,
``accel``).

``python3 -m bench.dev_parse_probe [--mib 64]`` builds each corpus on the GPU, compresses it with
every variant of ``VARIANTS`` (keywords of ``torch_pagecomp.kernels.lz4_compress.compress_pages``),
checks that our decoder gives every page back bit-exactly (``WRONG`` otherwise), and prints
compress GB/s, ratio, LZ4 sequences per page, and decompress GB/s of those blocks, beside
nvCOMP's batched LZ4 (its own blocks; bitshuffle for typed corpora) in the same run. On the CPU
(``TRITON_INTERPRET=1``) it is a dry run on a few pages.
"""

from __future__ import annotations

import argparse
import time

import torch

import torch_pagecomp as pc
from bench import nvcomp
from bench.corpora import build_corpus, element_size
from bench.timing import gbps, measure, median
from torch_pagecomp import format as fmt
from torch_pagecomp.kernels import lz4_compress as C
from torch_pagecomp.kernels import lz4_decompress as D

VARIANTS = {  # every flag spelled out, so a variant means the same whatever the defaults
    "greedy": dict(lazy=False, skip=False, back=False, min_match=4),
    "skip": dict(lazy=False, skip=True, back=False, min_match=4),
    "lazy": dict(lazy=True, skip=False, back=False, min_match=4),
    "min5": dict(lazy=False, skip=False, back=False, min_match=5),
    "lazy_min5_skip": dict(lazy=True, skip=True, back=False, min_match=5),
    "lazy_skip": dict(lazy=True, skip=True, back=False, min_match=4),
    "lazy_skip_back": dict(lazy=True, skip=True, back=True, min_match=4),
    "lazy_min5_skip_back": dict(lazy=True, skip=True, back=True, min_match=5),
    "accel1": dict(lazy=True, skip=True, back=True, min_match=5, accel=1),
    "accel2": dict(lazy=True, skip=True, back=True, min_match=5, accel=2),
    "accel4": dict(lazy=True, skip=True, back=True, min_match=5, accel=4),
    "w64_accel1": dict(lazy=True, skip=True, back=True, min_match=5, accel=1, window=64),
    # the probe option (model: bench/results/model_probe_*.md); typed corpora only (window 64)
    "w64_accel1_probe16": dict(lazy=True, skip=True, back=True, min_match=5, accel=1, window=64,
                               probe=16),
    "w64_accel1_probe32": dict(lazy=True, skip=True, back=True, min_match=5, accel=1, window=64,
                               probe=32),
    # the defaults with the bit-shuffle from bytes / from 64-bit loads
    "shuffle_bytes": dict(shuffle_wide=False),
    "shuffle_wide": dict(shuffle_wide=True),
    # longer minimum matches: fewer, longer sequences (decode speed) for some ratio
    "mm6": dict(min_match=6),
    "mm8": dict(min_match=8),
    # occupancy: programs (one warp each) per SM (H200, h200_088227b: 24 and 32 slower than 16)
    "pps8": dict(programs_per_sm=8),
    "pps12": dict(programs_per_sm=12),
    "pps20": dict(programs_per_sm=20),
    "pps24": dict(programs_per_sm=24),
    "pps32": dict(programs_per_sm=32),
    # more one-warp programs per SM under a register cap (typed compressor: 96 registers, 21
    # warps per SM at most)
    "pps20_r96": dict(programs_per_sm=20, maxnreg=96),
    "pps24_r80": dict(programs_per_sm=24, maxnreg=80),
    "pps32_r64": dict(programs_per_sm=32, maxnreg=64),
    # the hash table: 2048 / 1024 / 512 / 256 entries; "store": plain loads and stores of it
    "hb11": dict(hash_bits=11),
    "hb10": dict(hash_bits=10),
    "hb9": dict(hash_bits=9),
    "hb8": dict(hash_bits=8),
    "store": dict(candidates="store"),
    # typed pages: the hash table (the typed default before 2026-11-26) against "planes" (no
    # table: distances 1-16 and one or two planes back) and the parse around it
    "hashed": dict(candidates="store-max", near=4),
    "planes_w128": dict(candidates="planes", window=128),
    "planes_accel0": dict(candidates="planes", accel=0),
    "planes_probe0": dict(candidates="planes", probe=0),
    "planes_probe16": dict(candidates="planes", probe=16),
    "planes_xw1": dict(candidates="planes", extra_words=1),
    "xw2": dict(extra_words=2),
    "back_on": dict(back=True),  # the backward extension (off on typed pages by default)
    "lazy_on": dict(lazy=True),  # the lazy step (off on typed pages by default)
    "planes_near4": dict(candidates="planes", near=4),
    # the gate of "planes" (default on) against accel 1 / probe 32, which did its job before
    "nogate_accel1": dict(candidates="planes", gate=False, accel=1),
    "nogate_accel1_probe32": dict(candidates="planes", gate=False, accel=1, probe=32),
    "gate_accel1": dict(candidates="planes", gate=True, accel=1),
    "nogroup": dict(group=False),  # the window gate alone (same blocks as the default)
    "pairs_off": dict(pairs=False),  # the still-plane scan on 32-bit loads (same blocks)
    "default": {},
}
# decoder settings timed per row (keywords of ``decompress_into``), chosen with --decoders:
# the defaults, the checked loop alone (the decoder before the fast loop), the fast loop in both
# kernels, no prefetch / prefetch into L2. (The byte tile unshuffle that the word tile replaced:
# H200, bench/results/h200_300e11a/, columns default / pf1 against words / words_pf1; a tile
# unshuffle storing 64-bit words was 1.5-1.8x slower: h200_1a67841/wide_probe.txt.)
DECODERS = {
    "default": {},
    "lean=1": {"lean": 1},
    "lean=2": {"lean": 2},
    "pf0": {"prefetch": 0},
    "pf2": {"prefetch": 2},
    # not a decoder: shuffled blocks decoded as plain LZ4 (no unshuffle; the bytes stay shuffled,
    # so the row is not checked): the unshuffle's share of the time, by difference
    "decode_only": {"decode_only": True},
}
CORPORA = ("text", "binary", "mixed", "bf16-relu", "gpt-kv", "gpt-act", "fp32-randn")


def sequences(payload: torch.Tensor, sizes: torch.Tensor, kinds: torch.Tensor, k: int) -> float:
    """Mean LZ4 sequences per LZ4 page over the first ``k`` pages (host parse)."""
    total = pages = 0
    pay, sz, kd = payload[:k].cpu(), sizes[:k].cpu().tolist(), (kinds[:k].cpu() & 15).tolist()
    for i in range(len(sz)):
        if kd[i] != fmt.KIND_LZ4:
            continue
        b = bytes(pay[i, : sz[i]].numpy())
        j, n = 0, 0
        while j < len(b):
            t = b[j]
            j += 1
            lit = t >> 4
            if lit == 15:
                while True:
                    j += 1
                    lit += b[j - 1]
                    if b[j - 1] != 255:
                        break
            j += lit
            if j >= len(b):
                break
            j += 2
            n += 1
            if t & 15 == 15:
                while b[j] == 255:
                    j += 1
                j += 1
        total += n
        pages += 1
    return total / max(1, pages)


def _compiled() -> set:
    """The compressor's compiled kernels (a set of cache entries; empty where this Triton keeps
    them elsewhere)."""
    try:
        return {(d, k, id(v)) for d, c in C._lz4_compress_kernel.device_caches.items()
                for k, v in c[0].items()}
    except (AttributeError, IndexError, TypeError):
        return set()


def _regs(entry) -> str:
    d, k, _ = entry
    kern = C._lz4_compress_kernel.device_caches[d][0][k]
    return f"{getattr(kern, 'n_regs', '?')} registers, {getattr(kern, 'n_spills', '?')} spills"


def _variant_row(name: str, v: str, pages: torch.Tensor, e: int, dev: torch.device,
                 decoders: list[str]) -> str:
    """One table row: compress with variant ``v``, check the round trip, time both ways."""
    kw = VARIANTS[v]
    n, p = pages.shape
    offsets = torch.arange(n, device=dev, dtype=torch.int64) * p
    out = torch.empty_like(pages)
    status = torch.empty(n, dtype=torch.int32, device=dev)
    # traced=False: a direct launch, as the ops make in eager mode (a wrap_triton launch outside
    # an op costs ~200 us of host time, enough to leave the GPU idle between 64 MiB calls)
    seen = _compiled()
    payload, sizes, kinds = C.compress_pages(pages, e, traced=False, **kw)
    for k in _compiled() - seen:  # compiled for this row: its registers and spills
        print(f"# {name} {v}: {_regs(k)}", flush=True)
    ct = median(measure(lambda: C.compress_pages(pages, e, traced=False, **kw), dev, 20, 3))
    out.fill_(0xA5)
    flat = payload.view(-1)
    D.decompress_into(flat, offsets, sizes, kinds, out, status)
    ok = bool((status == 0).all()) and torch.equal(out, pages)
    dts = []
    for knobs in (DECODERS[d] for d in decoders):
        knobs = dict(knobs)
        plain = knobs.pop("decode_only", False)
        kd = kinds & 15 if plain else kinds

        def run(knobs=knobs, kd=kd):
            D.decompress_into(flat, offsets, sizes, kd, out, status, traced=False, **knobs)

        dts.append(median(measure(run, dev, 20, 3)))
        ok = ok and bool((status == 0).all()) and (plain or torch.equal(out, pages))
    ratio = n * p / float(sizes.sum())
    seq = sequences(payload, sizes, kinds, 512)
    return (f"| {name} | {e} | {v} | {gbps(n * p, ct):.1f} | {ratio:.3f} | {seq:.0f} | "
            f"{' | '.join(f'{gbps(n * p, t):.1f}' for t in dts)} | {'ok' if ok else 'WRONG'} |")


def _warm_up(pages: torch.Tensor, e: int, dev: torch.device, seconds: float = 0.5) -> None:
    """Compress ``pages`` back to back for ``seconds``, so that the first row is not timed on a
    card still raising its clocks."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        C.compress_pages(pages, e, traced=False)
        torch.cuda.synchronize(dev)


def _api_row(name: str, pages: torch.Tensor, e: int, dev: torch.device, cols: int) -> str:
    """The public API on the same pages (new output buffers each call)."""
    n, p = pages.shape
    c = pc.compress(pages, element_size=e)
    ct = median(measure(lambda: pc.compress(pages, element_size=e), dev, 20, 3))
    dt = median(measure(lambda: pc.decompress(c, return_status=True), dev, 20, 3))
    back, st = pc.decompress(c, return_status=True)
    ok = bool((st == 0).all()) and torch.equal(back, pages)
    return (f"| {name} | {e} | api | {gbps(n * p, ct):.1f} | {c.ratio():.3f} | - | "
            f"{gbps(n * p, dt):.1f} | {'- | ' * (cols - 1)}{'ok' if ok else 'WRONG'} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--corpora", default=",".join(CORPORA))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--decoders", default="default,lean=1,lean=2")
    a = ap.parse_args()
    decoders = a.decoders.split(",")
    unknown = [v for v in a.variants.split(",") if v not in VARIANTS]
    unknown += [d for d in decoders if d not in DECODERS]
    if unknown:  # before any corpus is built: a typo costs no device time
        ap.error(f"unknown variants / decoders: {', '.join(unknown)}")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    nbytes = (a.mib << 20) if cuda else 4 * 4096
    nv, why = nvcomp.load() if cuda else (None, "no GPU")
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; nvCOMP: "
          f"{nv.version if nv else why}; {nbytes >> 20} MiB per corpus, 4 KiB pages")
    print("| corpus | E | variant | compress GB/s | ratio | seq/page | decompress GB/s "
          + " | ".join(decoders) + " | ok |")
    print("|---" * (7 + len(decoders)) + "|")
    for name in a.corpora.split(","):
        e = element_size(name)
        pages = build_corpus(name, nbytes, 4096, dev, seed=7)
        n, p = pages.shape
        if cuda:  # clocks up before the first row: half a second of default compressions
            _warm_up(pages, e, dev)
        for v in a.variants.split(","):
            print(_variant_row(name, v, pages, e, dev, decoders), flush=True)
        if cuda:
            print(_api_row(name, pages, e, dev, len(decoders)), flush=True)
        if nv is not None:
            for w in sorted({1, e}):
                plan = nvcomp.LZ4Plan(nv, pages, w)
                ct = median(measure(plan.compress, dev, 20, 3))
                dt = median(measure(plan.decompress, dev, 20, 3))
                ok = plan.compress_ok() and plan.roundtrip_ok()
                ratio = n * p / plan.stored_bytes()
                print(f"| {name} | {w} | nvCOMP{' +bitshuffle' if w > 1 else ''} | "
                      f"{gbps(n * p, ct):.1f} | {ratio:.3f} | - | {gbps(n * p, dt):.1f} | "
                      f"{'- | ' * (len(decoders) - 1)}{'ok' if ok else 'WRONG'} |", flush=True)
                del plan


if __name__ == "__main__":
    main()
