"""The CPU store (``offload._stores.CpuStore``: the activation hooks' store for CPU tensors with
``offload_cpu=True``, and a KV cache's on a CPU without the Triton interpreter): every size
around the page, each codec, with and without checksums, restored bit for bit into poisoned
outputs, contiguous or not; a stored byte flipped is an error, never wrong bytes."""

from __future__ import annotations

import pytest
import torch
from conftest import POISON

from torch_pagecomp import exp_codec
from torch_pagecomp.format import CorruptPageError
from torch_pagecomp.offload._stores import CpuStore

P = 4096
SIZES = [0, 1, P - 1, P, 3 * P, 3 * P + 5, 17 * P + 2047]
CODECS = [(1, None), (2, None), (2, "bf16"), (2, "fp16")]


def activations(n: int, gen: torch.Generator) -> torch.Tensor:
    """``uint8 [n]``: bf16 ReLU(normal) values (compressible, not constant), cut at ``n``."""
    x = torch.relu(torch.randn(n // 2 + 1, generator=gen)).to(torch.bfloat16)
    return x.view(torch.uint8)[:n].clone()


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"e{c[0]}-{c[1] or 'lz4'}")
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_into_poisoned_outputs(n, codec, checksum, gen):
    element_size, float_format = codec
    store = CpuStore(compress=True, page_size=P, checksum=checksum)
    src = activations(n, gen)
    stored = store.offload(src, element_size, float_format)
    assert stored.nbytes == n and stored.exp == bool(float_format and n)
    if n:
        assert stored.kind == "compressed"
        assert stored.data.checksums is None if not checksum else stored.data.checksums.numel()
        assert stored.host_nbytes() == stored.data.payload.numel() + (
            stored.data.sizes.numel() * (13 + 4 * checksum))
    src_copy = src.clone()
    out = torch.full((n,), POISON, dtype=torch.uint8)
    store.restore(stored, out)
    assert torch.equal(out, src) and torch.equal(src, src_copy)  # the source left as it was
    wide = torch.full((2 * n,), POISON, dtype=torch.uint8)  # every other byte: not contiguous
    store.restore(stored, wide[::2])
    assert torch.equal(wide[::2], src) and bool((wide[1::2] == POISON).all())
    store.free(stored)
    assert stored.freed and stored.data is None


@pytest.mark.parametrize("float_format", [None, "bf16"])
def test_a_flipped_stored_byte_is_an_error(float_format, gen):
    """A bit of the stored bytes flipped, with checksums: the restore raises, whether the page
    fails to decode or decodes to other bytes (the checksum's catch)."""
    store = CpuStore(compress=True, page_size=P, checksum=True)
    src = activations(8 * P, gen)
    stored = store.offload(src, 2, float_format)
    payload = stored.data.payload
    payload[int(torch.randint(0, payload.numel(), (1,), generator=gen))] ^= 0x10
    out = torch.full_like(src, POISON)
    with pytest.raises(CorruptPageError):
        store.restore(stored, out)


def test_bf16_takes_the_exponent_codec_where_asked_and_the_pages_say_so(gen):
    store = CpuStore(compress=True, page_size=P)
    src = activations(4 * P, gen)
    exp = store.offload(src, 2, "bf16")
    lz4 = store.offload(src, 2)
    assert {int(k) & 15 for k in exp.data.kinds} <= {3, 0, 2} and exp.data.codec == "exp"
    assert {int(k) & 15 for k in lz4.data.kinds} <= {1, 0, 2} and lz4.data.codec == "lz4"
    if exp_codec.NATIVE:
        assert exp.host_nbytes() < lz4.host_nbytes()  # 1.42x against LZ4's 1.2-1.4x
