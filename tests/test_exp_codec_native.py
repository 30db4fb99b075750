"""The exponent codec's C loops (``_native.exp_encode_pages`` / ``exp_decode_pages``, what
``exp_codec.compress_exp_cpu`` / ``decompress_exp_cpu`` run where the extension is built)
against the numpy reference (``native=False``) bit for bit: payload, sizes and kinds; pages
and statuses; on fresh random pages each run, hostile pages and a mutation fuzz. Outputs of
the C calls sit in poisoned buffers between guards: every byte of them written, nothing
around them. Skipped where the extension is not built.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import POISON
from test_exp_codec import LAYOUTS, PAGE_SIZES, _exp_fuzz_chunk, float_pages, hostile_batch

from torch_pagecomp import exp_codec as ec
from torch_pagecomp import format as fmt

pytestmark = pytest.mark.skipif(not ec.NATIVE, reason="torch_pagecomp._native is not built "
                                "(or built without the exponent loops)")
GUARD = 37  # poisoned bytes before and after each output


@pytest.fixture(params=["scalar", "sse2", "ssse3"])
def lookup(request):
    """Each of the C exponent loops, in turn (``_native.exp_lookup``): 16 values a step with
    SSSE3's byte shuffle where the CPU has it or SSE2's compares, and the scalar loops that
    CPUs without SSE2 run: the same bytes and statuses. Restored to the one the module chose
    after."""
    from torch_pagecomp import _native

    if not hasattr(_native, "exp_lookup"):
        if request.param != "scalar":
            pytest.skip("no SSE2 loops here (not x86-64): the scalar loops only")
        yield request.param
        return
    chosen = _native.exp_lookup()
    if request.param == "ssse3" and chosen != "ssse3":
        pytest.skip("this CPU has no SSSE3")
    _native.exp_lookup(request.param)
    yield request.param
    _native.exp_lookup(chosen)


def tie_pages(gen: torch.Generator, page_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``uint8 [4, P]``: 16, 8 and 7 exponents each held by exactly as many values (the table
    picks among equal counts by value), then 5 exponents in counts 2:2:2:2:1; shuffled."""
    n = page_size // 2
    rows = []
    for k in (16, 8, 7, 9):
        e = torch.arange(n) % k
        if k == 9:
            e = torch.where(e >= 4, e // 2 + 2, e // 2)  # 0, 1, 4, 5 twice in 9; 6 once
        mant = 1 + torch.rand(n, generator=gen) / 2
        v = 2.0 ** (e - 4).float() * mant
        rows.append(v[torch.randperm(n, generator=gen)])
    return torch.stack([r.to(dtype).view(torch.uint8) for r in rows])


def guarded(n_bytes: int, dtype=np.uint8, fill=POISON) -> tuple[np.ndarray, np.ndarray]:
    """``(whole, inner)``: a poisoned array of ``n_bytes // itemsize + 2 * GUARD`` items and
    its middle ``n_bytes // itemsize``."""
    count = n_bytes // np.dtype(dtype).itemsize
    whole = np.full(count + 2 * GUARD, fill, dtype=dtype)
    return whole, whole[GUARD:GUARD + count]


def guards_intact(whole: np.ndarray, fill=POISON) -> bool:
    return bool((whole[:GUARD] == fill).all() and (whole[-GUARD:] == fill).all())


def native_encode(pages: torch.Tensor, layout: int):
    """``_native.exp_encode_pages`` into poisoned, guarded outputs."""
    from torch_pagecomp import _native

    n, p = pages.shape
    ow, out = guarded(n * p)
    sw, sizes = guarded(4 * n, np.int32, -0x5A5A5A5B)
    kw, kinds = guarded(n)
    _native.exp_encode_pages(pages.numpy().reshape(-1), out, sizes, kinds, p, layout)
    assert guards_intact(ow) and guards_intact(sw, -0x5A5A5A5B) and guards_intact(kw)
    return out.reshape(n, p), sizes, kinds


def native_decode(payload, offsets, sizes, kinds, page_size):
    """``_native.exp_decode_pages`` into poisoned, guarded outputs."""
    from torch_pagecomp import _native

    n = sizes.shape[0]
    ow, out = guarded(n * page_size)
    sw, status = guarded(4 * n, np.int32, -0x5A5A5A5B)
    _native.exp_decode_pages(np.ascontiguousarray(payload), np.ascontiguousarray(offsets[:n]),
                             np.ascontiguousarray(sizes), np.ascontiguousarray(kinds), out,
                             status, page_size)
    assert guards_intact(ow) and guards_intact(sw, -0x5A5A5A5B)
    return out.reshape(n, page_size), status


def assert_encodes_equal(pages: torch.Tensor, layout: int) -> tuple:
    want = ec.compress_exp_cpu(pages, layout, native=False)
    got = native_encode(pages, layout)
    for name, a, b in zip(("payload", "sizes", "kinds"), want, got):
        assert np.array_equal(a.numpy(), b), name
    wrapped = ec.compress_exp_cpu(pages, layout)  # the default: C, on the codec's threads
    assert all(torch.equal(a, b) for a, b in zip(want, wrapped))
    return want


def assert_decodes_equal(payload, offsets, sizes, kinds, page_size) -> torch.Tensor:
    want, want_st = ec.decompress_exp_cpu(payload, offsets, sizes, kinds, page_size,
                                          native=False)
    out, status = native_decode(payload.numpy(), offsets.numpy(), sizes.numpy(), kinds.numpy(),
                                page_size)
    assert status.tolist() == want_st.tolist()
    assert np.array_equal(out, want.numpy())
    got, got_st = ec.decompress_exp_cpu(payload, offsets, sizes, kinds, page_size)
    assert torch.equal(got_st, want_st) and torch.equal(got, want)
    return want_st


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_native_equals_reference(name, page_size, gen, lookup):
    """float_pages (every exponent shape) and pages of tied exponent counts, both layouts,
    every page size: the C encode's bytes, sizes and kinds, then its decode of them."""
    layout, dtype = LAYOUTS[name]
    pages = torch.cat([float_pages(gen, page_size, dtype), tie_pages(gen, page_size, dtype)])
    payload, sizes, kinds = assert_encodes_equal(pages, layout)
    assert {int(k) & 15 for k in kinds} == {fmt.KIND_EXP, fmt.KIND_RAW, fmt.KIND_FILL}
    n = pages.shape[0]
    offsets = torch.arange(n + 1, dtype=torch.int64) * page_size  # [N + 1]: the first N read
    status = assert_decodes_equal(payload.view(-1), offsets, sizes, kinds, page_size)
    assert not status.any()
    got, _ = ec.decompress_exp_cpu(payload.view(-1), offsets, sizes, kinds, page_size)
    assert torch.equal(got, pages)


def test_native_random_bf16_batch(gen, lookup):
    """A batch of random-normal bf16 pages of scales 1e-6..1e6 (most EXP, a few escapes)."""
    x = torch.randn(256, 2048, generator=gen) * torch.logspace(-6, 6, 256)[:, None]
    pages = x.to(torch.bfloat16).view(torch.uint8)
    payload, sizes, kinds = assert_encodes_equal(pages, fmt.EXP_BF16)
    offsets = torch.arange(256, dtype=torch.int64) * 4096
    assert not assert_decodes_equal(payload.view(-1), offsets, sizes, kinds, 4096).any()


def test_native_hostile_pages(gen, lookup):
    """The hostile batch of test_exp_codec: statuses and bytes equal, into poisoned outputs."""
    payload, offsets, sizes, kinds = hostile_batch(gen)
    status = assert_decodes_equal(payload, offsets, sizes, kinds, 4096)
    assert set(status.tolist()) == {fmt.STATUS_OK, fmt.STATUS_BAD_KIND, fmt.STATUS_BAD_SIZE}


def outside_scrambled(flat: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                      g: np.random.Generator) -> np.ndarray:
    """``flat`` with every byte outside all pages' ``[offset, offset + size)`` (clipped to the
    payload) replaced by random bytes."""
    total = flat.shape[0]
    start = np.clip(offsets, 0, total)
    stop = np.clip(offsets + np.maximum(sizes.astype(np.int64), 0), 0, total)
    edges = np.zeros(total + 1, dtype=np.int64)
    np.add.at(edges, start, 1)
    np.add.at(edges, stop, -1)
    covered = np.cumsum(edges[:-1]) > 0
    out = flat.copy()
    out[~covered] = g.integers(0, 256, int((~covered).sum()), dtype=np.uint8)
    return out


@pytest.mark.parametrize("page_size", [4096, 16384])
def test_native_mutation_fuzz(page_size, gen, lookup):
    """A few thousand mutated pages (test_exp_codec's GPU fuzz mutations, on the CPU: bit
    flips, overwritten code bytes, sizes cut or grown, kind bytes changed, offsets moved;
    then a payload cut short at a random place): the C decoder's statuses and bytes equal the
    reference's; its output does not change when every byte outside the pages' stored ranges
    is scrambled (it reads none of them); unmutated pages decode to their source."""
    p = page_size
    n = 3072 if p == 4096 else 384
    srcs = torch.cat([float_pages(gen, p, dtype) for dtype in (torch.bfloat16, torch.float16)
                      for _ in range(4)])
    half = srcs.shape[0] // 2
    parts = [ec.compress_exp_cpu(srcs[:half], fmt.EXP_BF16),
             ec.compress_exp_cpu(srcs[half:], fmt.EXP_FP16)]
    base, base_sizes, base_kinds = (torch.cat(t) for t in zip(*parts))
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    g = torch.Generator().manual_seed(seed)
    rows, sizes, kinds, offsets, pure, pick = _exp_fuzz_chunk(base, base_sizes, base_kinds, n, g)
    flat = rows.reshape(-1)
    cut = int(torch.randint(flat.shape[0] - 3 * p, flat.shape[0] + 1, (1,), generator=g))
    flat = flat[:cut].clone()
    msg = f"fuzz seed {seed}"
    status = assert_decodes_equal(flat, offsets, sizes, kinds, p)
    assert set(status.tolist()) <= {fmt.STATUS_OK, fmt.STATUS_BAD_KIND, fmt.STATUS_BAD_SIZE}
    assert len(set(status.tolist())) == 3, msg
    inside = (offsets + p <= cut).numpy()
    assert not status[pure & torch.from_numpy(inside)].any(), msg
    out, _ = native_decode(flat.numpy(), offsets.numpy(), sizes.numpy(), kinds.numpy(), p)
    ok = (status == 0).numpy() & pure.numpy() & inside
    assert np.array_equal(out[ok], srcs[pick[torch.from_numpy(ok)]].numpy()), msg
    scrambled = outside_scrambled(flat.numpy(), offsets.numpy(), sizes.numpy(),
                                  np.random.default_rng(seed))
    out2, status2 = native_decode(scrambled, offsets.numpy(), sizes.numpy(), kinds.numpy(), p)
    assert np.array_equal(status2, status.numpy()) and np.array_equal(out2, out), msg


def test_native_boundary_errors():
    from torch_pagecomp import _native

    p, n = 4096, 2
    raw = np.zeros(n * p, np.uint8)
    out, sizes, kinds = np.zeros(n * p, np.uint8), np.zeros(n, np.int32), np.zeros(n, np.uint8)
    _native.exp_encode_pages(raw, out, sizes, kinds, p, fmt.EXP_BF16)
    assert sizes.tolist() == [1, 1] and kinds.tolist() == [fmt.KIND_FILL] * 2
    with pytest.raises(ValueError, match="page_size"):
        _native.exp_encode_pages(raw, out, sizes, kinds, 3000, fmt.EXP_BF16)
    with pytest.raises(ValueError, match="layout"):
        _native.exp_encode_pages(raw, out, sizes, kinds, p, 3)
    with pytest.raises(TypeError, match="sizes must hold int32"):
        _native.exp_encode_pages(raw, out, sizes.astype(np.int64), kinds, p, fmt.EXP_BF16)
    with pytest.raises(TypeError, match="out must be a C-contiguous writable"):
        _native.exp_encode_pages(raw, bytes(n * p), sizes, kinds, p, fmt.EXP_BF16)
    with pytest.raises(ValueError, match="need raw"):
        _native.exp_encode_pages(raw[:-1], out, sizes, kinds, p, fmt.EXP_BF16)
    with pytest.raises(TypeError, match="raw must"):
        _native.exp_encode_pages(raw.reshape(n, p)[:, ::2], out, sizes, kinds, p, 1)
    offsets, status = np.arange(n, dtype=np.int64) * p, np.zeros(n, np.int32)
    sizes[:] = 1
    args = [out, offsets, sizes, kinds, raw, status, p]
    _native.exp_decode_pages(*args)
    assert not status.any()
    for k, bad, match in [(1, offsets.astype(np.int32), "offsets must hold int64"),
                          (1, offsets[:1], "at least 2 offsets"),
                          (2, sizes.astype(np.uint32), "sizes must hold int32"),
                          (3, kinds[:1], "2 kinds"),
                          (4, raw[:-1], "out of 8192 bytes"),
                          (5, status.astype(np.int64), "status must hold int32"),
                          (6, 8192 + 1, "page_size")]:
        with pytest.raises((TypeError, ValueError), match=match):
            _native.exp_decode_pages(*args[:k], bad, *args[k + 1:])


def test_reference_path_forced(gen, monkeypatch):
    """``native=False`` and an unbuilt extension (``NATIVE`` False) both run the numpy code."""
    pages = float_pages(gen, 4096, torch.bfloat16)
    want = ec.compress_exp_cpu(pages, fmt.EXP_BF16, native=False)
    monkeypatch.setattr(ec, "NATIVE", False)
    monkeypatch.setattr(ec, "_native", None)
    got = ec.compress_exp_cpu(pages, fmt.EXP_BF16)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    offsets = torch.arange(pages.shape[0], dtype=torch.int64) * 4096
    out, status = ec.decompress_exp_cpu(want[0].view(-1), offsets, want[1], want[2], 4096)
    assert not status.any() and torch.equal(out, pages)
