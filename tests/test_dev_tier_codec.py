"""The two-tier exponent-code probe (``bench/dev_tier_codec.py``, issue #23): its numpy
reference round-trips every exponent shape bit for bit, its sizes are the format's, and its
Triton decoder (under the interpreter on the CPU) gives the reference's bytes, and a bad
size instead of bytes for a page whose size its codes do not add up to. So the speed it
measures on a GPU is a correct decoder's."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import POISON
from pages import bf16_exponent_pages

tc = pytest.importorskip("bench.dev_tier_codec")
P = 4096


def test_reference_round_trip_and_sizes(gen):
    pages = bf16_exponent_pages(gen, P).numpy()
    payload, sizes = tc.encode(pages)
    assert (tc.decode(payload, sizes) == pages).all()
    assert sizes[1] == tc.fixed_bytes(P, 0)  # one exponent: no other, no escape
    assert sizes[2] == P  # random bits (all 256 exponents): stored raw
    assert (sizes <= P).all() and ((sizes == P) | (sizes <= P - P // 32)).all()
    # a page with exactly 3 + 7 + 1 exponents: 1 escape per value of the 11th
    n = P // 2
    e = np.repeat(np.arange(100, 111), n // 11 + 1)[:n]
    v = (e << 7) | (np.arange(n) & 0x7F)
    one = v.astype("<u2").view(np.uint8).reshape(1, P)
    payload, sizes = tc.encode(one)
    m = int((e >= 103).sum())  # values outside the 3 most frequent (ties: smaller first)
    escaped = int((e == 110).sum())
    assert sizes[0] == tc.fixed_bytes(P, m) + escaped
    assert (tc.decode(payload, sizes) == one).all()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels need the interpreter or CUDA")
def test_triton_decoder_equals_the_reference(gen):
    pages = bf16_exponent_pages(gen, P)
    payload, sizes = tc.encode(pages.numpy())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = torch.from_numpy(payload).to(dev)
    s = torch.from_numpy(sizes).to(dev)
    got, status = tc.decode_triton(p, s)
    assert (status == 0).all()
    assert torch.equal(got.cpu(), pages)
    # a size its codes do not add up to: status 2, the row not written
    stored = int(np.flatnonzero(sizes < P)[0])
    s_bad = s.clone()
    s_bad[stored] += 1
    out = torch.full_like(p, POISON)
    status = torch.empty(p.shape[0], dtype=torch.int32, device=dev)
    tc._tier_decode_kernel[(p.shape[0],)](p, s_bad.to(torch.int32), out, status, PAGE=P)
    assert int(status[stored]) == 2
    assert bool((out[stored] == POISON).all())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels need the interpreter or CUDA")
def test_triton_encoder_equals_the_reference(gen):
    """The Triton encoder writes the reference's sizes and bytes, nothing past a page's size
    (the output poisoned first), and its pages decode back."""
    pages = bf16_exponent_pages(gen, P)
    want_payload, want_sizes = tc.encode(pages.numpy())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = pages.to(dev)
    payload = torch.full_like(src, POISON)
    sizes = torch.empty(src.shape[0], dtype=torch.int32, device=dev)
    tc._tier_encode_kernel[(src.shape[0],)](src, payload, sizes, PAGE=P)
    assert sizes.cpu().tolist() == want_sizes.tolist()
    got = payload.cpu().numpy()
    for r, n in enumerate(want_sizes.tolist()):
        assert (got[r, :n] == want_payload[r, :n]).all(), r
        assert (got[r, n:] == POISON).all(), r
    out, status = tc.decode_triton(payload, sizes)
    assert (status == 0).all() and torch.equal(out.cpu(), pages)
