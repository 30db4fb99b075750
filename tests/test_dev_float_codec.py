"""The exponent-codec probe (``bench/dev_float_codec.py``, issue #23): its Triton encoder and
decoder are bit-identical to its numpy reference (under the interpreter on the CPU), so the
speeds it measures on a GPU are those of a correct codec."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import POISON
from pages import assert_probe_kernels_equal_reference, bf16_exponent_pages

fc = pytest.importorskip("bench.dev_float_codec")
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                 not torch.cuda.is_available(),
                                 reason="Triton kernels need the interpreter or CUDA")
P = 4096


def test_reference_round_trip_and_sizes(gen):
    pages = bf16_exponent_pages(gen, P).numpy()
    payload, sizes = fc.encode_ref(pages)
    n, sm_at, esc_at = fc.layout(P)
    assert (sizes >= esc_at).all()
    assert sizes[1] == esc_at  # one exponent: no escape
    ok = sizes <= fc.limit(P)
    out, status = fc.decode_ref(payload, sizes, P)
    assert (status[ok] == 0).all() and (out[ok] == pages[ok]).all()
    assert (status[~ok] == fc.STATUS_BAD_SIZE).all()  # those pages are stored RAW
    assert not ok[2]  # random bits: more than the limit, RAW


@interpreter
def test_kernels_equal_reference(gen):
    pages = bf16_exponent_pages(gen, P)
    if torch.cuda.is_available():
        pages = pages.cuda()
    assert_probe_kernels_equal_reference(fc, pages, POISON)


@interpreter
def test_hostile_sizes_and_codes_never_read_past_the_page(gen):
    """Sizes off by one either way, over the limit, and random code bytes: statuses equal the
    reference's, failed pages come back zero."""
    pages = bf16_exponent_pages(gen, P)[:2]
    payload, sizes = fc.encode_ref(pages.numpy())
    payload = np.repeat(payload, 4, axis=0)
    sizes = np.repeat(sizes, 4).astype(np.int64)
    sizes[0::4] += 1
    sizes[1::4] -= 1
    sizes[2::4] = P
    rnd = torch.randint(0, 256, (2, 3 * P // 16), generator=gen, dtype=torch.uint8).numpy()
    payload[3::4, fc.K:fc.K + rnd.shape[1]] = rnd
    sizes = sizes.astype(np.int32)
    want, want_status = fc.decode_ref(payload, sizes, P)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got, status = fc.decode(torch.from_numpy(payload).to(dev), torch.from_numpy(sizes).to(dev))
    assert status.cpu().numpy().tolist() == want_status.tolist()
    assert np.array_equal(got.cpu().numpy(), want)
