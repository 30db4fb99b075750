"""``PageCompressor.restore`` that goes through host memory (review, session 91): a CPU
compressor's handle restored into CUDA memory, or a handle restored onto another GPU than its
compressor's, is decoded into host memory by a nested restore and copied up. The nested call
counted the restore a second time in ``counts`` (two restores and twice the bytes for one)."""

from __future__ import annotations

import pytest
import torch

from torch_pagecomp.module import PageCompressor

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _data(gen: torch.Generator, n: int) -> torch.Tensor:
    # a few values repeated: pages that compress, fresh each run
    return torch.randint(0, 4, (n,), dtype=torch.int32, generator=gen).to(torch.bfloat16)


def _restored_once(pc: PageCompressor, x: torch.Tensor, device) -> None:
    h = pc.offload(x)
    before = dict(pc.counts)
    y = pc.restore(h, device=device)
    want = torch.device(device)
    assert y.device.type == want.type and want.index in (None, y.device.index)
    assert torch.equal(y.cpu().view(torch.uint8), x.cpu().view(torch.uint8))
    assert pc.counts["restores"] - before["restores"] == 1
    assert pc.counts["bytes_restored"] - before["bytes_restored"] == h.nbytes
    h.free()


@cuda
@pytest.mark.parametrize("n", [1, 2048 + 3, 3 * 4096 + 17])
def test_a_cpu_compressors_handle_restored_into_cuda_counts_once(gen, n):
    with PageCompressor(device="cpu") as pc:
        _restored_once(pc, _data(gen, n), "cuda")


@cuda
def test_a_cpu_compressors_handle_restored_into_cuda_out_counts_once(gen):
    x = _data(gen, 5000)
    with PageCompressor(device="cpu") as pc:
        h = pc.offload(x)
        out = torch.full_like(x, float("nan"), device="cuda")  # poisoned: unwritten bytes show
        pc.restore(h, out=out)
        assert torch.equal(out.cpu().view(torch.uint8), x.view(torch.uint8))
        assert pc.counts["restores"] == 1
        assert pc.counts["bytes_restored"] == h.nbytes


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_handle_restored_onto_another_gpu_counts_once(gen):
    with PageCompressor(device="cuda:0") as pc:
        _restored_once(pc, _data(gen, 3 * 4096 + 17).cuda(0), "cuda:1")


def test_a_cpu_restore_still_counts_once(gen):
    with PageCompressor(device="cpu") as pc:
        _restored_once(pc, _data(gen, 3 * 4096 + 17), "cpu")
