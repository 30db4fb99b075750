"""Dev probe (#23): a two-tier fixed-width exponent code for bf16 pages, its numpy reference
and Triton encoder and decoder, to measure on a GPU before the package's EXP format would
change.

``bench/results/cpu_exponent_probe_tiers.md`` found that this code stores 1.461-1.517 on
bf16 pages where the package's fixed 3-bit code (EXP pages) stores 1.418-1.439. What it costs
on a GPU is the open question: ``python3 -m bench.dev_tier_codec`` (GPU) checks the Triton
encoder against the numpy reference and the round trip on each corpus, then times the
Triton encoder and decoder against the package's exponent codec (``compress(...,
codec="exp-bf16")``, ``decompress``) on the same pages, and prints GB/s of uncompressed bytes
and both ratios. On the CPU (``--device cpu``, Triton's interpreter) it only checks, on a few
pages.

A page of ``P`` bytes holds ``n = P / 2`` bf16 values, each split as the EXP format splits
it: an exponent ``e = (v >> 7) & 255`` and a rest byte ``r = sign << 7 | mantissa``. This
probe's page, in order:

1. ``t1``, 3 bytes: the page's 3 most frequent exponents (count descending, then value
   ascending, absent ones filling in that order);
2. ``t2``, 7 bytes: the next 7;
3. ``plane``, ``n / 4`` bytes: a 2-bit code ``c1`` per value, value ``i`` at bits
   ``2 (i % 4)`` of byte ``i // 4``: ``c1 < 3`` is ``t1[c1]``, 3 is "other";
4. ``rest``, ``n`` bytes: ``r``;
5. ``second``, ``3 ceil(m / 8)`` bytes for the page's ``m`` others: a 3-bit code ``c2`` per
   other, in order, 8 to a little-endian 3-byte group (the EXP format's 3-bit stream):
   ``c2 < 7`` is ``t2[c2]``, 7 an escape;
6. ``escapes``: one byte per escape, in order: ``e``.

Its size is ``F(m) + x`` with ``F(m) = 10 + n / 4 + n + 3 ceil(m / 8)`` and ``x`` escapes. A
page whose size would pass ``P - P / 32`` is stored raw (this probe keeps such pages out of
the timing: it counts them). A decoder finds an other's ``c2`` and an escape's byte by prefix
sums of the flags, as the EXP decoder finds its escapes: no bit-serial decoding.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import triton
import triton.language as tl

from torch_pagecomp.exp_codec import join_values, pack3, split_values, unpack3
from torch_pagecomp.format import EXP_BF16  # the EXP format's value split and 3-bit stream

HEAD = 10  # t1 and t2
_HEAD = tl.constexpr(HEAD)  # the same, for the kernels (a global they may read)


def fixed_bytes(page: int, others: int) -> int:
    """``F(m)``: the bytes of a page with ``others`` values outside ``t1``, less its escapes."""
    n = page // 2
    return HEAD + n // 4 + n + 3 * ((others + 7) // 8)


def encode(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``uint8 [N, P]`` bf16 pages -> ``(payload uint8 [N, P], sizes int64 [N])`` (the
    reference encoder; size ``P``: a raw page, the input as it is)."""
    n_pages, page = pages.shape
    n = page // 2
    v = pages.view("<u2").astype(np.int64)
    e, rest, _ = split_values(v, EXP_BF16)
    counts = np.zeros((n_pages, 256), dtype=np.int64)
    np.add.at(counts, (np.arange(n_pages)[:, None], e), 1)
    order = np.argsort(-counts, axis=1, kind="stable")  # ties: the smaller exponent first
    rank = np.empty_like(order)
    rank[np.arange(n_pages)[:, None], order] = np.arange(256)
    r = np.take_along_axis(rank, e, axis=1)
    payload = np.zeros((n_pages, page), dtype=np.uint8)
    sizes = np.empty(n_pages, dtype=np.int64)
    for p in range(n_pages):
        c1 = np.minimum(r[p], 3)
        other = r[p] >= 3
        c2 = np.minimum(r[p][other] - 3, 7)
        esc = e[p][other][c2 == 7]
        m = int(other.sum())
        size = fixed_bytes(page, m) + esc.size
        if size > page - page // 32:
            payload[p] = pages[p]
            sizes[p] = page
            continue
        out = payload[p]
        out[:HEAD] = order[p, :HEAD]
        out[HEAD:HEAD + n // 4] = (c1.reshape(-1, 4) << (2 * np.arange(4))).sum(axis=1)
        out[HEAD + n // 4:HEAD + n // 4 + n] = rest[p]
        groups = (m + 7) // 8
        padded = np.zeros((1, groups * 8), dtype=np.int64)
        padded[0, :m] = c2
        at = HEAD + n // 4 + n
        out[at:at + 3 * groups] = pack3(padded)[0]
        out[at + 3 * groups:size] = esc
        sizes[p] = size
    return payload, sizes


def decode(payload: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Inverse of :func:`encode` (the reference decoder; trusts its input)."""
    n_pages, page = payload.shape
    n = page // 2
    out = np.empty((n_pages, page), dtype=np.uint8)
    for p in range(n_pages):
        src = payload[p]
        if sizes[p] == page:
            out[p] = src
            continue
        plane = src[HEAD:HEAD + n // 4].astype(np.int64)
        c1 = ((plane[:, None] >> (2 * np.arange(4))) & 3).reshape(-1)
        rest = src[HEAD + n // 4:HEAD + n // 4 + n].astype(np.int64)
        other = c1 == 3
        m = int(other.sum())
        at = HEAD + n // 4 + n
        c2 = unpack3(src[None, at:at + 3 * ((m + 7) // 8)])[0, :m]
        e = src[np.minimum(c1, 2)].astype(np.int64)
        e2 = src[3 + np.minimum(c2, 6)].astype(np.int64)
        esc = c2 == 7
        e2[esc] = src[fixed_bytes(page, m):fixed_bytes(page, m) + int(esc.sum())]
        e[other] = e2
        out[p] = join_values(e, rest, None, EXP_BF16).astype("<u2").view(np.uint8)
    return out


@triton.jit
def _tier_decode_kernel(payload_ptr, sizes_ptr, pages_ptr, status_ptr, PAGE: tl.constexpr):
    """Program ``i`` decodes page ``i`` (at ``i * PAGE`` in the payload, ``sizes[i]`` bytes;
    ``PAGE`` bytes: raw) into ``pages[i]``; ``status[i]`` 0, or 2 (bad size: a size that its
    codes do not add up to, nothing stored)."""
    N: tl.constexpr = PAGE // 2
    pid = tl.program_id(0)
    src = payload_ptr + pid.to(tl.int64) * PAGE
    row = pages_ptr + pid.to(tl.int64) * PAGE
    size = tl.load(sizes_ptr + pid)
    i = tl.arange(0, N)
    if size == PAGE:
        tl.store(row + 2 * i, tl.load(src + 2 * i))
        tl.store(row + 2 * i + 1, tl.load(src + 2 * i + 1))
        tl.store(status_ptr + pid, 0)
    else:
        c1 = (tl.load(src + _HEAD + i // 4).to(tl.int32) >> (2 * (i % 4))) & 3
        other = (c1 == 3).to(tl.int32)
        k = tl.cumsum(other, axis=0) - other  # this other's place in the second stream
        m = tl.sum(other, axis=0)
        AT: tl.constexpr = _HEAD + N // 4 + N
        fixed = AT + 3 * ((m + 7) // 8)
        fits = ((fixed <= size) & (size <= PAGE - PAGE // 32)).to(tl.int32)
        mo = (other * fits) != 0  # the second stream lies inside the page's size
        g = src + AT + 3 * (k // 8)
        word = (tl.load(g, mask=mo, other=0).to(tl.int32)
                | (tl.load(g + 1, mask=mo, other=0).to(tl.int32) << 8)
                | (tl.load(g + 2, mask=mo, other=0).to(tl.int32) << 16))
        c2 = (word >> (3 * (k % 8))) & 7
        esc = (mo & (c2 == 7)).to(tl.int32)
        j = tl.cumsum(esc, axis=0) - esc
        if (fits != 0) & (size == fixed + tl.sum(esc, axis=0)):
            e = tl.where(other == 0, tl.load(src + tl.minimum(c1, 2)).to(tl.int32),
                         tl.where(esc == 0, tl.load(src + 3 + tl.minimum(c2, 6)).to(tl.int32),
                                  tl.load(src + fixed + j, mask=esc != 0, other=0)
                                  .to(tl.int32)))
            rest = tl.load(src + _HEAD + N // 4 + i).to(tl.int32)
            v = ((rest & 0x80) << 8) | (e << 7) | (rest & 0x7F)
            tl.store(row + 2 * i, (v & 255).to(tl.uint8))
            tl.store(row + 2 * i + 1, (v >> 8).to(tl.uint8))
            tl.store(status_ptr + pid, 0)
        else:
            tl.store(status_ptr + pid, 2)


@triton.jit
def _tier_encode_kernel(pages_ptr, payload_ptr, sizes_ptr, PAGE: tl.constexpr):
    """Program ``i`` encodes page ``i`` into ``payload[i]`` (the bytes :func:`encode` writes
    up to the page's size) and ``sizes[i]``. The others' 3-bit codes are compacted through
    the rest bytes' place in the row: each other's code is stored at its rank there, read
    back 8 at a time into the second stream, then the rest bytes are written over them."""
    N: tl.constexpr = PAGE // 2
    AT: tl.constexpr = _HEAD + N // 4 + N
    pid = tl.program_id(0)
    src = pages_ptr + pid.to(tl.int64) * PAGE
    dst = payload_ptr + pid.to(tl.int64) * PAGE
    i = tl.arange(0, N)
    v = tl.load(src + 2 * i).to(tl.int32) | (tl.load(src + 2 * i + 1).to(tl.int32) << 8)
    e = (v >> 7) & 255
    rest = ((v >> 8) & 0x80) | (v & 0x7F)
    bins = tl.arange(0, 256)
    # count * 256 + 255 - exponent: distinct keys, the largest the next table entry (count
    # descending, then exponent ascending)
    keys = tl.histogram(e, 256) * 256 + 255 - bins
    rank = tl.full([N], 10, tl.int32)
    for t in tl.static_range(10):
        x = 255 - (tl.max(keys, axis=0) & 255)
        tl.store(dst + t, x.to(tl.uint8))
        rank = tl.where(e == x, t, rank)
        keys = tl.where(bins == x, -1, keys)
    other = (rank >= 3).to(tl.int32)
    c1 = tl.minimum(rank, 3)
    c2 = tl.minimum(rank - 3, 7)
    m = tl.sum(other, axis=0)
    k = tl.cumsum(other, axis=0) - other
    esc = other * (c2 == 7).to(tl.int32)
    j = tl.cumsum(esc, axis=0) - esc
    fixed = AT + 3 * ((m + 7) // 8)
    size = fixed + tl.sum(esc, axis=0)
    if size > PAGE - PAGE // 32:  # raw
        tl.store(dst + 2 * i, (v & 255).to(tl.uint8))
        tl.store(dst + 2 * i + 1, (v >> 8).to(tl.uint8))
        tl.store(sizes_ptr + pid, PAGE)
    else:
        plane = tl.sum(tl.reshape(c1, (N // 4, 4)) << (2 * tl.arange(0, 4))[None, :], axis=1)
        tl.store(dst + _HEAD + tl.arange(0, N // 4), plane.to(tl.uint8))
        scratch = dst + _HEAD + N // 4  # the rest bytes' place, written last
        tl.store(scratch + k, c2.to(tl.uint8), mask=other != 0)
        tl.store(dst + fixed + j, e.to(tl.uint8), mask=esc != 0)
        tl.debug_barrier()
        gk = tl.arange(0, N // 8)
        groups = (m + 7) // 8
        word = tl.zeros([N // 8], tl.int32)
        for t in tl.static_range(8):
            at = 8 * gk + t
            word |= tl.load(scratch + at, mask=at < m, other=0).to(tl.int32) << (3 * t)
        tl.debug_barrier()  # every code read before the rest bytes overwrite them
        g = dst + AT + 3 * gk
        tl.store(g, (word & 255).to(tl.uint8), mask=gk < groups)
        tl.store(g + 1, ((word >> 8) & 255).to(tl.uint8), mask=gk < groups)
        tl.store(g + 2, (word >> 16).to(tl.uint8), mask=gk < groups)
        tl.store(scratch + i, rest.to(tl.uint8))
        tl.store(sizes_ptr + pid, size)


def encode_triton(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode` by the Triton kernel: ``(payload uint8 [N, P], sizes int32 [N])``;
    bytes past a page's size are not written."""
    n, page = pages.shape
    payload = torch.empty_like(pages)
    sizes = torch.empty(n, dtype=torch.int32, device=pages.device)
    _tier_encode_kernel[(n,)](pages, payload, sizes, PAGE=page, num_warps=4)
    return payload, sizes


def decode_triton(payload: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """:func:`decode` by the Triton kernel: ``(pages uint8 [N, P], status int32 [N])``."""
    n, page = payload.shape
    pages = torch.empty_like(payload)
    status = torch.empty(n, dtype=torch.int32, device=payload.device)
    _tier_decode_kernel[(n,)](payload, sizes.to(torch.int32), pages, status, PAGE=page,
                              num_warps=4)
    return pages, status


def _gbps(fn, nbytes: int, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", default="bf16-randn,bf16-relu,gpt-act,gpt-kv,gpt-weights")
    ap.add_argument("--mib", type=float, default=32.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    import torch_pagecomp as pc
    from bench.corpora import build_corpus

    page = 4096
    print("| corpus | tier ratio | EXP ratio | raw pages (tier) | tier encode GB/s | EXP encode "
          "GB/s | tier decode GB/s | EXP decode GB/s | round trip |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.corpora.split(","):
        mib = a.mib if a.device == "cuda" else 0.05
        data = build_corpus(name, int(mib * 2**20) // page * page, seed=0).view(-1, page)
        want_payload, want_sizes = encode(data.numpy())
        src = data.to(a.device)
        payload, sizes = encode_triton(src)
        same = sizes.cpu().tolist() == want_sizes.tolist() and all(
            (payload[r, :n].cpu().numpy() == want_payload[r, :n]).all()
            for r, n in enumerate(want_sizes.tolist()))
        got, status = decode_triton(payload, sizes)
        ok = same and bool((status == 0).all()) and torch.equal(got.cpu(), data)
        ratio = data.numel() / float(sizes.sum())
        c = pc.compress(src, codec="exp-bf16")
        exp_ratio = data.numel() / float(c.sizes.sum())
        enc = dec = exp_enc = exp_dec = float("nan")
        if a.device == "cuda":
            nb = data.numel()
            enc = _gbps(lambda x=src: encode_triton(x), nb, a.reps)
            exp_enc = _gbps(lambda x=src: pc.compress(x, codec="exp-bf16"), nb, a.reps)
            dec = _gbps(lambda p=payload, s=sizes: decode_triton(p, s), nb, a.reps)
            exp_dec = _gbps(lambda c=c: pc.decompress(c, return_status=True), nb, a.reps)
        print(f"| {name} | {ratio:.3f} | {exp_ratio:.3f} | {int((sizes == page).sum())} | "
              f"{enc:.0f} | {exp_enc:.0f} | {dec:.0f} | {exp_dec:.0f} | {ok} |", flush=True)


if __name__ == "__main__":
    main()
