"""The exponent-window probe (``bench/dev_float_window.py``, issue #23): its Triton encoder and
decoder are bit-identical to its numpy reference (under the interpreter on the CPU), it picks
the window the docstring says, and hostile pages give the reference's statuses."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import POISON
from pages import assert_probe_kernels_equal_reference, bf16_exponent_pages

fw = pytest.importorskip("bench.dev_float_window")
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                 not torch.cuda.is_available(),
                                 reason="Triton kernels need the interpreter or CUDA")
P = 4096
N = P // 2


def _shaped_pages(gen: torch.Generator) -> torch.Tensor:
    """Pages that steer the window choice: ReLU-like (half zeros: mode 1), zeros plus one small
    exponent (m <= 6: zeros inside a mode-0 window), values one step above a dense range (the
    window one below the maximum wins), and the shapes of ``bf16_exponent_pages``."""
    relu = (torch.randn(N, generator=gen) * 0.02).clamp_min(0).to(torch.bfloat16)
    tiny = torch.zeros(N, dtype=torch.int16)
    tiny[::3] = 3 << 7  # exponent 3, the rest zero
    top = (torch.randn(N, generator=gen) * 0.02).to(torch.bfloat16)
    top[0] = 1.0  # one value far above the others: m - 1 and below hold the mass
    rows = [relu.view(torch.uint8), tiny.view(torch.bfloat16).view(torch.uint8),
            top.view(torch.uint8)]
    return torch.cat([torch.stack(rows), bf16_exponent_pages(gen, P)])


def test_reference_round_trip_sizes_and_window_choice(gen):
    pages = _shaped_pages(gen).numpy()
    payload, sizes = fw.encode_ref(pages)
    ok = sizes <= fw.limit(P)
    out, status = fw.decode_ref(payload, sizes, P)
    assert (status[ok] == 0).all() and (out[ok] == pages[ok]).all()
    assert (status[~ok] == fw.STATUS_BAD_SIZE).all()  # those pages are stored RAW
    base, mode = payload[:, 0], payload[:, 1]
    assert mode[0] == 1  # ReLU: code 6 is zero
    assert sizes[1] == fw.layout(P)[2]  # zeros and exponent 3: no escape
    e_top = (pages[2].view("<u2").astype(np.int64) >> 7) & 255
    assert base[2] < e_top.max()  # the window under the outlier (which escapes)
    assert mode[4] == 0 and sizes[4] == fw.layout(P)[2]  # one exponent: no escape
    assert not ok[5]  # random bits: RAW


def test_window_covers_at_least_the_top_seven_on_model_like_pages(gen):
    """Gaussian bf16 pages at several scales, half of them with four outliers 2^8 times the
    bulk (as LLM activations have): the window stores no more than the table of the 7 most
    frequent exponents plus 5 bytes (its header is 5 shorter)."""
    from bench import dev_float_codec as table

    x = torch.randn(16, N, generator=gen) * torch.logspace(-4, 1, 16)[:, None]
    x[::2, torch.randint(0, N, (4,), generator=gen)] *= 256
    pages = x.to(torch.bfloat16).view(torch.uint8).numpy()
    _, w = fw.encode_ref(pages)
    _, t = table.encode_ref(pages)
    assert (w <= t + 5).all()


@interpreter
def test_kernels_equal_reference(gen):
    pages = _shaped_pages(gen)
    if torch.cuda.is_available():
        pages = pages.cuda()
    assert_probe_kernels_equal_reference(fw, pages, POISON)


@interpreter
def test_hostile_pages_decode_as_the_reference(gen):
    """Sizes off by one either way and over the limit, random code bytes, random headers (a
    base below its codes, mode bytes above 1): statuses and bytes equal the reference's,
    failed pages come back zero."""
    pages = _shaped_pages(gen)[[0, 2]]
    payload, sizes = fw.encode_ref(pages.numpy())
    payload = np.repeat(payload, 5, axis=0)
    sizes = np.repeat(sizes, 5).astype(np.int64)
    sizes[0::5] += 1
    sizes[1::5] -= 1
    sizes[2::5] = P
    rnd = torch.randint(0, 256, (2, 3 * N // 8), generator=gen, dtype=torch.uint8).numpy()
    payload[3::5, fw.HEADER:fw.HEADER + rnd.shape[1]] = rnd
    payload[4::5, :2] = torch.randint(0, 256, (2, 2), generator=gen, dtype=torch.uint8).numpy()
    sizes = sizes.astype(np.int32)
    want, want_status = fw.decode_ref(payload, sizes, P)
    assert (want_status[4::5] == 0).all()  # a header is never invalid: other bytes come back
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got, status = fw.decode(torch.from_numpy(payload).to(dev), torch.from_numpy(sizes).to(dev))
    assert status.cpu().numpy().tolist() == want_status.tolist()
    assert np.array_equal(got.cpu().numpy(), want)
