"""Dev probe (issue #23): would a lossless per-page "exponent codec" beat LZ4 + bit-shuffle on bf16?

Per corpus of bf16 pages, the ratio (input bytes / stored bytes) of:

* ``current``: the package's CPU codec (``_ops.compress_eager(pages, element_size=2)``:
  bit-shuffle + LZ4, FILL and RAW pages), from the sizes it returns;
* ``H`` / ``ideal``: the exponent's entropy (bits a value; mean of pages, pooled) and the bound
  ``16 / (8 + H_page)`` (exponent entropy-coded, the rest raw), as total / ideal bytes;
* ``K=7`` / ``K=15``, counted to the bit: 2-byte header, a table of the page's K most frequent
  exponents (K bytes), each exponent a fixed 3/4-bit code whose last value escapes to a raw
  8-bit exponent, sign + mantissa raw (8 bits a value); ``esc``: share of escaped values;
* ``2/3``, ``2/2``: a two-tier fixed code (:func:`tiered_sizes`): 2-bit codes for the 3 most
  frequent exponents and "other", then 3-bit (2-bit) codes for the next 7 (3) and an escape;
* ``huffman``: per-page canonical Huffman exponent codes, lengths <= 12 (package-merge where
  Huffman goes deeper); 2-byte header, 1-byte count, 8-bit symbol + 4-bit length per symbol;
* ``lz4-exp``: 2 bytes + LZ4 of the bit-shuffled exponent plane (raw if larger) + raw rest;
* ``best``: per page the smallest of ``current``, ``K=7``, ``K=15`` (a new kind beside today's).

New formats store a page RAW (``P`` bytes) unless smaller, an all-equal page as FILL (1 byte).
These are format-level ratios computed on the CPU: no speed is measured. Data, built here:
saved activations (``saved_tensors_hooks``) and weights of a bf16 ``nn.TransformerEncoder``
and a Llama-style block (random init), ``randn * 0.02``, the bf16 corpora of ``bench.corpora``.

    python -m bench.dev_exponent_probe [--mib 16] [--page 4096] [--out probe.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from collections.abc import Callable

import lz4.block
import numpy as np
import torch
import torch.nn as nn

from torch_pagecomp import _ops, cpu_codec

from . import corpora
from .stock_models import _llama

HUFF_LIMIT = 12
HUFF_SYMBOL_BITS = 12  # 8-bit symbol + 4-bit code length per used symbol
BF16 = torch.bfloat16


# ------------------------------------------------------------------------------ data
def _encoder() -> nn.Module:
    """``nn.TransformerEncoder``: d 512, 8 heads, MLP 2048, 2 layers, pre-norm, GELU."""
    layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "encoder": _encoder,
    "llama": lambda: _llama(512, 2),  # RMSNorm, RoPE, GQA, SwiGLU (bench.stock_models)
}


def _saved(model: nn.Module) -> list[torch.Tensor]:
    """The bf16 tensors autograd saves in one forward (batch 4, seq 256), flat; parameters
    and further views of one saved buffer left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[tuple] = set()
    out: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if t.dtype == BF16 and key[0] not in params and key not in seen:
            seen.add(key)
            out.append(t.detach().reshape(-1))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(4, 256, 512, dtype=BF16))
    return out


def model_bytes(make: Callable[[], nn.Module], nbytes: int, seed: int, weights: bool):
    """At least ``nbytes`` of the weights (default init) or saved activations of freshly
    seeded bf16 models, as one flat bf16 tensor."""
    out: list[torch.Tensor] = []
    step = 0
    while sum(t.numel() for t in out) * 2 < nbytes:
        torch.manual_seed(seed + step)
        model = make().to(BF16)
        out += [p.detach().reshape(-1) for p in model.parameters()] if weights else _saved(model)
        step += 1
    return torch.cat(out)


def build_corpora(nbytes: int, page: int, seed: int) -> dict[str, torch.Tensor]:
    """``{name: uint8 [N, page]}`` for every corpus this probe reports."""
    n = max(1, nbytes // page)

    def pages(flat: torch.Tensor) -> torch.Tensor:
        return flat[: n * page // 2].contiguous().view(torch.uint8).view(n, page)

    out = {}
    for name, make in MODELS.items():
        out[f"{name}-act"] = pages(model_bytes(make, nbytes, seed, weights=False))
        out[f"{name}-weights"] = pages(model_bytes(make, nbytes, seed, weights=True))
    gen = torch.Generator().manual_seed(seed)
    out["randn-0.02"] = pages((torch.randn(n * page // 2, generator=gen) * 0.02).to(BF16))
    for name, corpus in corpora.CORPORA.items():
        if corpus.element_size == 2:
            out[name] = corpora.build_corpus(name, nbytes, page, seed=seed)
    return out


# --------------------------------------------------------------------------- formats
def exponents(pages: np.ndarray) -> np.ndarray:
    """``uint8 [N, P]`` of bf16 values -> their 8-bit exponents, ``uint8 [N, P / 2]``."""
    return ((pages.view("<u2") >> 7) & 0xFF).astype(np.uint8)


def histograms(exp: np.ndarray) -> np.ndarray:
    """Per-page exponent counts: ``int64 [N, 256]``."""
    n = exp.shape[0]
    flat = exp.astype(np.int64) + 256 * np.arange(n)[:, None]
    return np.bincount(flat.ravel(), minlength=256 * n).reshape(n, 256)


def entropy(counts: np.ndarray) -> np.ndarray:
    """Shannon entropy (bits per value) of each row of counts."""
    p = counts / counts.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=-1)


def stored(sizes: np.ndarray, fill: np.ndarray, page: int) -> np.ndarray:
    """Apply the page rules: FILL pages 1 byte, pages not smaller than ``page`` RAW."""
    return np.where(fill, 1, np.minimum(sizes, page))


def fixed_k_sizes(counts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes per page of the fixed-code format with a K-entry table, and escapes per page."""
    m = counts.sum(axis=1)
    escapes = m - np.sort(counts, axis=1)[:, -k:].sum(axis=1)
    code_bits = (k + 1).bit_length() - 1  # K = 2^b - 1 codes + escape
    bits = m * code_bits + escapes * 8 + m * 8
    return 2 + k + (bits + 7) // 8, escapes


def tiered_sizes(counts: np.ndarray, first: int, second: int) -> np.ndarray:
    """Bytes per page of a two-tier fixed code: a ``first``-bit code per value for the page's
    ``2^first - 1`` most frequent exponents, its last value ("other") followed, in a stream
    of its own, by a ``second``-bit code for the next ``2^second - 1`` exponents, whose last
    value escapes to a raw 8-bit exponent; a table of both tiers' exponents (a byte each),
    sign + mantissa raw. Both code streams have fixed-width fields, so a decoder finds a
    value's second-tier code by counting the "other" values before it (a prefix sum, as the
    escapes of ``K=7`` are found): no variable-length decoding."""
    k1, k2 = (1 << first) - 1, (1 << second) - 1
    top = -np.sort(-counts, axis=1)
    m = counts.sum(axis=1)
    other = m - top[:, :k1].sum(axis=1)
    escapes = other - top[:, k1:k1 + k2].sum(axis=1)
    bits = m * (8 + first) + other * second + escapes * 8
    return 2 + k1 + k2 + (bits + 7) // 8


def huffman_lengths(w: list[int]) -> list[int]:
    """Huffman code lengths for weights ``w`` (all > 0); a lone symbol needs 0 bits."""
    n = len(w)
    if n == 1:
        return [0]
    heap = [(x, i) for i, x in enumerate(w)]
    heapq.heapify(heap)
    parent = [0] * (2 * n - 1)
    nxt = n
    while len(heap) > 1:
        a, i = heapq.heappop(heap)
        b, j = heapq.heappop(heap)
        parent[i] = parent[j] = nxt
        heapq.heappush(heap, (a + b, nxt))
        nxt += 1
    depth = [0] * (2 * n - 1)
    for node in range(2 * n - 3, -1, -1):  # a parent's index is above its children's
        depth[node] = depth[parent[node]] + 1
    return depth[:n]


def package_merge(w: list[int], limit: int) -> list[int]:
    """Optimal code lengths for weights ``w`` with none above ``limit`` (package-merge)."""
    n = len(w)
    leaves = sorted(((x, (i,)) for i, x in enumerate(w)), key=lambda t: t[0])
    row = leaves
    for _ in range(limit - 1):
        pkgs = [(row[k][0] + row[k + 1][0], row[k][1] + row[k + 1][1])
                for k in range(0, len(row) - 1, 2)]
        row = sorted(leaves + pkgs, key=lambda t: t[0])
    lengths = [0] * n
    for _, syms in row[: 2 * n - 2]:
        for s in syms:
            lengths[s] += 1
    return lengths


def huffman_sizes(counts: np.ndarray) -> np.ndarray:
    """Bytes per page of the per-page canonical Huffman exponent format."""
    out = np.empty(counts.shape[0], dtype=np.int64)
    for r, row in enumerate(counts):
        w = row[row > 0].tolist()
        lengths = huffman_lengths(w)
        if max(lengths) > HUFF_LIMIT:
            lengths = package_merge(w, HUFF_LIMIT)
        bits = sum(c * n for c, n in zip(w, lengths)) + int(row.sum()) * 8
        out[r] = 2 + 1 + (len(w) * HUFF_SYMBOL_BITS + 7) // 8 + (bits + 7) // 8
    return out


def lz4_exponent_sizes(exp: np.ndarray) -> np.ndarray:
    """Bytes per page: 2 + LZ4 of the bit-shuffled exponent plane (raw if larger) + raw
    sign + mantissa plane (one byte a value)."""
    n, m = exp.shape
    bits = np.unpackbits(exp[:, :, None], axis=2).transpose(0, 2, 1)
    planes = np.ascontiguousarray(np.packbits(bits, axis=2).reshape(n, m))
    lz = np.array([len(lz4.block.compress(r.tobytes(), store_size=False)) for r in planes])
    return 2 + np.minimum(lz, m) + m


def measure(pages_t: torch.Tensor) -> dict:
    """Every ratio and statistic of one corpus (``uint8 [N, P]`` bf16 pages)."""
    pages = np.ascontiguousarray(pages_t.numpy())
    n, page = pages.shape
    total = n * page
    _, cur_t, _ = _ops.compress_eager(pages_t, element_size=2)
    cur = cur_t.numpy().astype(np.int64)
    fill = cpu_codec.fill_rows(pages)
    exp = exponents(pages)
    counts = histograms(exp)
    h_page = entropy(counts)
    ideal = exp.shape[1] * (8 + h_page) / 8
    k7, esc7 = fixed_k_sizes(counts, 7)
    k15, esc15 = fixed_k_sizes(counts, 15)
    k7s, k15s = stored(k7, fill, page), stored(k15, fill, page)
    sizes = {"current": cur, "K=7": k7s, "K=15": k15s,
             "2/3": stored(tiered_sizes(counts, 2, 3), fill, page),
             "2/2": stored(tiered_sizes(counts, 2, 2), fill, page),
             "huffman": stored(huffman_sizes(counts), fill, page),
             "lz4-exp": stored(lz4_exponent_sizes(exp), fill, page),
             "best": np.minimum(cur, np.minimum(k7s, k15s))}
    return {
        "mib": total / 2**20, "pages": n, "fill_pages": int(fill.sum()),
        "h_exp_page_mean": float(h_page.mean()), "h_exp_pooled": float(entropy(counts.sum(0))),
        "ideal": total / float(ideal.sum()),
        **{f"ratio_{k}": total / int(v.sum()) for k, v in sizes.items()},
        "raw_pages": {k: int((v == page).sum()) for k, v in sizes.items()},
        "escape_share_k7": float(esc7.sum() / exp.size),
        "escape_share_k15": float(esc15.sum() / exp.size),
        "distinct_exp_page_mean": float((counts > 0).sum(1).mean()),
    }


COLUMNS = [("corpus", 15, None), ("MiB", 6, "mib"), ("current", 7, "ratio_current"),
           ("H exp", 6, "h_exp_page_mean"), ("H pool", 6, "h_exp_pooled"), ("ideal", 6, "ideal"),
           ("K=7", 6, "ratio_K=7"), ("K=15", 6, "ratio_K=15"), ("2/3", 6, "ratio_2/3"),
           ("2/2", 6, "ratio_2/2"), ("huff", 6, "ratio_huffman"),
           ("lz4exp", 6, "ratio_lz4-exp"), ("best", 6, "ratio_best"),
           ("esc7", 7, "escape_share_k7"), ("esc15", 7, "escape_share_k15")]


def table(rows: dict[str, dict]) -> str:
    """The results as a fixed-width text table."""
    lines = ["  ".join(f"{h:>{w}}" if key else f"{h:<{w}}" for h, w, key in COLUMNS)]
    for name, r in rows.items():
        cells = [f"{name:<15}"]
        for _, w, key in COLUMNS[1:]:
            v = r[key]
            cells.append(f"{v:>{w}.3%}" if key.startswith("escape") else f"{v:>{w}.3f}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Build the corpora, measure each, print the table, write ``--out`` if given."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=16.0, help="MiB per corpus")
    ap.add_argument("--page", type=int, default=4096, help="page size in bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    data = build_corpora(int(args.mib * 2**20), args.page, args.seed)
    rows = {name: measure(pages) for name, pages in data.items()}
    print(table(rows))
    print(f"(page {args.page} B; ratios = input bytes / stored bytes; "
          f"{time.perf_counter() - t0:.1f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"page": args.page, "mib": args.mib, "seed": args.seed,
                       "huffman_limit": HUFF_LIMIT, "corpora": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
