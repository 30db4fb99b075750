"""Page builders for tests: real files from this machine, patterns, hostile shapes."""

from __future__ import annotations

import functools
import os
import random
import sysconfig
from pathlib import Path

import torch


@functools.cache
def _file_bytes(kind: str, limit: int = 8 << 20) -> bytes:
    if kind == "text":
        root, suffixes = Path(sysconfig.get_paths()["stdlib"]), (".py",)
    else:
        root, suffixes = Path(os.path.dirname(torch.__file__)) / "lib", (".so",)
    chunks, total = [], 0
    for path in sorted(root.rglob("*")):
        if path.suffix in suffixes and path.is_file():
            data = path.read_bytes()[: 1 << 20]
            chunks.append(data)
            total += len(data)
            if total >= limit:
                break
    return b"".join(chunks)


def file_pages(kind: str, n: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` pages cut at random page-aligned places from text (.py) or binary (.so) files."""
    data = torch.frombuffer(bytearray(_file_bytes(kind)), dtype=torch.uint8)
    count = data.numel() // page_size
    pick = torch.randint(0, count, (n,), generator=gen)
    return data[: count * page_size].view(count, page_size)[pick].clone()


def periodic_pages(period: int, n: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    base = torch.randint(0, 256, (n, period), dtype=torch.uint8, generator=gen)
    reps = -(-page_size // period)
    return base.repeat(1, reps)[:, :page_size].contiguous()


def run_pages(n: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Long runs of one byte with random lengths (1..2000) and values."""
    out = torch.empty((n, page_size), dtype=torch.uint8)
    for i in range(n):
        pos = 0
        while pos < page_size:
            length = int(torch.randint(1, 2000, (1,), generator=gen))
            out[i, pos : pos + length] = int(torch.randint(0, 256, (1,), generator=gen))
            pos += length
    return out


def mixed_pages(n: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes, zeros, same-filled, text, binary, periodic and runs, shuffled together."""
    k = max(1, n // 7)
    parts = [
        torch.randint(0, 256, (k, page_size), dtype=torch.uint8, generator=gen),
        torch.zeros((k, page_size), dtype=torch.uint8),
        torch.randint(0, 256, (k, 1), dtype=torch.uint8, generator=gen).expand(k, page_size),
        file_pages("text", k, page_size, gen),
        file_pages("binary", k, page_size, gen),
        periodic_pages(int(torch.randint(1, 18, (1,), generator=gen)), k, page_size, gen),
        run_pages(max(1, n - 6 * k), page_size, gen),
    ]
    pages = torch.cat([p.contiguous() for p in parts])
    return pages[torch.randperm(pages.shape[0], generator=gen)].contiguous()


def kernel_device() -> str:
    """Where the Triton kernels run in this session: the GPU, else the CPU under the Triton
    interpreter; skips the calling test when neither is available."""
    import pytest

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cpu"


def bf16_exponent_pages(gen: torch.Generator, page_size: int = 4096) -> torch.Tensor:
    """``uint8 [6, page_size]`` bf16 pages of every exponent shape, for the exponent codecs:
    normal, one value, all 256 exponents (random bits), NaN / Inf / denormals / -0, zeros, and
    exponents spread over far more than 7 values."""
    n = page_size // 2
    rows = [
        (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16),
        torch.full((n,), 1.5).to(torch.bfloat16),
        torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32).to(torch.int16)
        .view(torch.bfloat16),
        torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -0.0] * (n // 5)
                     + [0.0] * (n % 5)).to(torch.bfloat16),
        torch.zeros(n, dtype=torch.bfloat16),
        (torch.randn(n, generator=gen) * torch.logspace(-20, 20, n)).to(torch.bfloat16),
    ]
    return torch.stack([r.view(torch.uint8) for r in rows])


def escape_rows_page(gen: torch.Generator, n: int, rows: dict[int, list[int]],
                     fp16: bool = False) -> torch.Tensor:
    """``uint8 [2n]``: a page of 16-bit floats (bf16, or ``fp16``) whose values take 7
    exponents (hundreds of values each: the table), except in row ``g`` of 8 values, where
    fields ``rows[g]`` take exponents outside it (escapes, each exponent a few times at most),
    with random signs and the other bits random."""
    base, other, shift = (8, 16, 10) if fp16 else (100, 150, 7)
    e = base + torch.randint(0, 7, (n,), generator=gen, dtype=torch.int32)
    for g, fields in rows.items():
        for t in fields:
            e[8 * g + t] = other + int(torch.randint(0, 15 if fp16 else 100, (1,), generator=gen))
    low = torch.randint(0, 1 << shift, (n,), generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int32) << 15
    return (sign | (e << shift) | low).to(torch.int16).view(torch.uint8)


def assert_probe_kernels_equal_reference(codec, pages: torch.Tensor, poison: int) -> None:
    """An exponent-codec probe's (``bench.dev_float_*``) Triton kernels against its numpy
    reference on ``pages`` (``uint8 [N, P]``): the same sizes and bytes, nothing written past a
    page's bytes (outputs poisoned), stored pages decoded exactly, oversized ones BAD_SIZE and
    zero."""
    import numpy as np

    p = pages.shape[1]
    want_payload, want_sizes = codec.encode_ref(pages.cpu().numpy())
    payload, sizes = codec.encode(pages, torch.full_like(pages, poison))
    assert sizes.cpu().numpy().tolist() == want_sizes.tolist()
    for i, s in enumerate(want_sizes.tolist()):
        k = min(s, p)
        assert np.array_equal(payload[i, :k].cpu().numpy(), want_payload[i, :k]), i
        assert bool((payload[i, k:] == poison).all())  # nothing written past the page's bytes
    out, status = codec.decode(payload, sizes, torch.full_like(pages, poison))
    ok = torch.from_numpy(want_sizes <= codec.limit(p)).to(status.device)
    assert torch.equal(status[ok], torch.zeros_like(status[ok]))
    assert torch.equal(out[ok], pages[ok])
    assert bool((status[~ok] == codec.STATUS_BAD_SIZE).all()) and bool((out[~ok] == 0).all())


def offload_cycles(pc, x: torch.Tensor, cycles: int, warm: int = 50) -> tuple[int, dict, dict]:
    """``warm`` then ``cycles`` rounds of ``pc.offload(x)``, ``restore``, ``free`` (checked
    every 500th) on a GPU; returns ``(GPU bytes allocated, stats)`` after the warm-up and the
    stats after the cycles, everything synchronised: for tests that nothing grows."""
    for _ in range(warm):
        pc.restore(pc.offload(x)).sum()
    torch.cuda.synchronize()
    pc.synchronize()
    dev0, s0 = torch.cuda.memory_allocated(), pc.stats()
    for i in range(cycles):
        h = pc.offload(x)
        y = pc.restore(h)
        h.free()
        if i % 500 == 0:
            assert torch.equal(y, x)
    del y, h
    torch.cuda.synchronize()
    pc.synchronize()
    return dev0, s0, pc.stats()


# ------------------------------------------------------------------ hand-made LZ4 blocks
def length_extension(n: int) -> bytes:
    """The extension bytes of an LZ4 length field holding ``n`` (none below 15: the token's
    nibble holds it)."""
    if n < 15:
        return b""
    n -= 15
    return b"\xff" * (n // 255) + bytes([n % 255])


def encode(seqs, final: bytes) -> bytes:
    """LZ4 block of sequences ``(literals, offset, match_length)`` then ``final`` literals."""
    out = bytearray()
    for lits, d, ml in seqs:
        lit, m = len(lits), ml - 4
        out.append((min(lit, 15) << 4) | min(m, 15))
        out += length_extension(lit) + lits + d.to_bytes(2, "little") + length_extension(m)
    out.append(min(len(final), 15) << 4)
    out += length_extension(len(final)) + final
    return bytes(out)


# periods of long overlapping matches: each side of the decoders' copy widths (16 bytes on the
# CPU; 32, 64 and 256 on the GPU), where they switch between storing a repeated pattern and
# reloading it
OVERLAP_PERIODS = (1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255,
                   256, 257, 300)


def long_overlap_blocks(page_size: int, rng: random.Random) -> list[bytes]:
    """Compliant blocks of ``page_size`` bytes, one per period of :data:`OVERLAP_PERIODS` and
    two random ones: random literals, then a match longer than its offset (a repeated pattern)
    at a random position and of a length no multiple of the period, ending anywhere in the
    last 300 bytes (so the block stays under the LZ4 size limit), then maybe a short
    overlapping match and the last literals."""
    blocks = []
    for d in OVERLAP_PERIODS + (rng.randrange(1, 257), rng.randrange(1, 257)):
        lead = rng.randrange(0, 40)  # the pattern's first byte lands at any position
        room = page_size - lead - d - 12
        ml = rng.randrange(max(d + 5, room - 300), room)
        seqs = [(rng.randbytes(lead + d), d, ml)]
        op = lead + d + ml
        if op + 30 < page_size - 12:  # a short overlapping match after it
            seqs.append((rng.randbytes(3), rng.randrange(1, 4), 9))
            op += 12
        blocks.append(encode(seqs, rng.randbytes(page_size - op)))
    return blocks
