"""The row-table kernel (``torch_pagecomp.kernels.row_table``) and the offload store's row table
built with it: every page's address, from three numbers per output, and nothing written past
the table. Without CUDA the kernel runs on the interpreter (the table is only numbers)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402

from torch_pagecomp.kernels.row_table import ROW_BLOCK, fill_row_table  # noqa: E402
from torch_pagecomp.offload import _decode  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -0x5A5A5A5A5A


def _expected(bases, counts, page_size):
    return [b + i * page_size for b, n in zip(bases, counts) for i in range(n)]


@pytest.mark.parametrize("page_size", [4096, 65536, 0])  # 0: each base repeated
def test_rows_are_each_outputs_pages_in_order_and_nothing_past_them(page_size, gen):
    k = int(torch.randint(1, 7, (1,), generator=gen))
    # counts across the block size (an output's last program is partly masked), and empty ones
    counts = [int(c) for c in torch.randint(0, 2 * ROW_BLOCK + 300, (k,), generator=gen)]
    counts[int(torch.randint(0, k, (1,), generator=gen))] = 0
    counts[0] = max(counts[0], 1)
    bases = [int(b) * 4096 for b in torch.randint(1, 1 << 40, (k,), generator=gen)]
    firsts = [sum(counts[:j]) for j in range(k)]
    total, spare = sum(counts), 37
    rows = torch.full((total + spare,), POISON, dtype=torch.int64, device=DEV)
    desc = torch.tensor([bases, firsts, counts], dtype=torch.int64, device=DEV)
    fill_row_table(desc, rows[:total], page_size, max(counts))
    got = rows.cpu().tolist()
    assert got[:total] == _expected(bases, counts, page_size)
    assert got[total:] == [POISON] * spare, "wrote past the table"


def test_bad_arguments_are_named():
    rows = torch.empty(4, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="desc must be int64"):
        fill_row_table(torch.zeros(2, 1, dtype=torch.int64, device=DEV), rows, 4096, 1)
    with pytest.raises(ValueError, match="rows must be a contiguous int64"):
        fill_row_table(torch.zeros(3, 1, dtype=torch.int64, device=DEV), rows.int(), 4096, 1)
    fill_row_table(torch.zeros(3, 0, dtype=torch.int64, device=DEV), rows[:0], 4096, 0)


def test_store_row_table_of_live_outputs(cuda, gen):
    """The hooks' batched restore: one row per page of each output, at that output's memory."""
    p = 4096
    outs = [torch.empty(int(n) * p, dtype=torch.uint8, device=cuda)
            for n in torch.randint(1, 3000, (5,), generator=gen)]
    rows = _decode._row_table(outs, p)
    want = _expected([o.data_ptr() for o in outs], [o.numel() // p for o in outs], p)
    assert rows.device.type == "cuda" and rows.cpu().tolist() == want


def test_ramps_of_stride_zero_repeat_each_value(cuda, gen):
    """A group restore's per-slice shift of the page offsets: ``np.repeat`` on the GPU."""
    counts = [int(n) for n in torch.randint(0, 5000, (6,), generator=gen)]
    values = [int(v) for v in torch.randint(0, 1 << 40, (6,), generator=gen)]
    got = _decode.ramps(values, counts, 0, cuda)
    assert got.cpu().tolist() == [v for v, n in zip(values, counts) for _ in range(n)]
    assert _decode.ramps([], [], 0, cuda).numel() == 0


def test_to_device_stages_through_page_locked_memory(gen):
    host = torch.randint(-(1 << 40), 1 << 40, (1000,), dtype=torch.int64, generator=gen)
    want = host.clone()
    dev = torch.device(DEV)
    up = _decode.to_device(host, dev)
    if dev.type == "cuda":
        host.zero_()  # staged by a host copy: the upload never reads the caller's tensor later
        torch.cuda.synchronize()
    assert up.device.type == dev.type and torch.equal(up.cpu(), want)


def _slice_case(gen, k: int):
    """``k`` slices' metadata (counts across the block size, one empty) as device tensors."""
    counts = [int(c) for c in torch.randint(0, 2 * ROW_BLOCK + 300, (k,), generator=gen)]
    counts[int(torch.randint(0, k, (1,), generator=gen))] = 0
    counts[0] = max(counts[0], 1)
    rels = [torch.randint(0, 1 << 40, (n,), generator=gen).to(DEV) for n in counts]
    sizes = [torch.randint(-(1 << 31), 1 << 31, (n,), generator=gen, dtype=torch.int64)
             .to(torch.int32).to(DEV) for n in counts]
    kinds = [torch.randint(0, 256, (n,), generator=gen).to(torch.uint8).to(DEV)
             for n in counts]
    return counts, rels, sizes, kinds


@pytest.mark.parametrize("page_size", [4096, 65536])
def test_slice_meta_is_each_slices_own_pages_in_order_and_nothing_past_them(page_size, gen):
    """One launch gathers every page's offset (its slice's plus the slice's shift), size, kind
    and row, slice after slice at each slice's first page, from the slices' own tensors."""
    from torch_pagecomp.kernels.row_table import gather_slice_meta

    k = int(torch.randint(1, 7, (1,), generator=gen))
    counts, rels, sizes, kinds = _slice_case(gen, k)
    # slices written out of order in the outputs: first pages need not follow the table
    perm = torch.randperm(k, generator=gen).tolist()
    firsts, at = [0] * k, 0
    for j in perm:
        firsts[j], at = at, at + counts[j]
    shifts = [int(s) for s in torch.randint(0, 1 << 30, (k,), generator=gen)]
    rows0 = [int(b) * 4096 for b in torch.randint(1, 1 << 40, (k,), generator=gen)]
    desc = torch.tensor([[r.data_ptr() for r in rels], [s.data_ptr() for s in sizes],
                         [t.data_ptr() for t in kinds], shifts, firsts, counts, rows0],
                        dtype=torch.int64, device=DEV)
    total, spare = sum(counts), 29
    offsets = torch.full((total + spare,), POISON, dtype=torch.int64, device=DEV)
    out_sizes = torch.full((total + spare,), -7, dtype=torch.int32, device=DEV)
    out_kinds = torch.full((total + spare,), 0xA5, dtype=torch.uint8, device=DEV)
    rows = torch.full((total + spare,), POISON, dtype=torch.int64, device=DEV)
    gather_slice_meta(desc, offsets[:total], out_sizes[:total], out_kinds[:total], rows[:total],
                      page_size, max(counts))
    want_off, want_sizes, want_kinds, want_rows = ([0] * total for _ in range(4))
    for j in range(k):
        for i in range(counts[j]):
            want_off[firsts[j] + i] = int(rels[j][i]) + shifts[j]
            want_sizes[firsts[j] + i] = int(sizes[j][i])
            want_kinds[firsts[j] + i] = int(kinds[j][i])
            want_rows[firsts[j] + i] = rows0[j] + i * page_size
    assert offsets.cpu().tolist() == want_off + [POISON] * spare
    assert out_sizes.cpu().tolist() == want_sizes + [-7] * spare
    assert out_kinds.cpu().tolist() == want_kinds + [0xA5] * spare
    assert rows.cpu().tolist() == want_rows + [POISON] * spare


def test_slice_meta_bad_arguments_are_named():
    from torch_pagecomp.kernels.row_table import gather_slice_meta

    i64 = torch.empty(4, dtype=torch.int64, device=DEV)
    i32 = torch.empty(4, dtype=torch.int32, device=DEV)
    u8 = torch.empty(4, dtype=torch.uint8, device=DEV)
    desc = torch.zeros(7, 1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=r"desc must be int64 \[7, K\]"):
        gather_slice_meta(desc[:3], i64, i32, u8, i64, 4096, 1)
    with pytest.raises(ValueError, match="sizes must be a contiguous torch.int32"):
        gather_slice_meta(desc, i64, i64, u8, i64, 4096, 1)
    with pytest.raises(ValueError, match="kinds must be a contiguous torch.uint8"):
        gather_slice_meta(desc, i64, i32, i32, i64, 4096, 1)
    with pytest.raises(ValueError, match="rows must be a contiguous torch.int64"):
        gather_slice_meta(desc, i64, i32, u8, i64[::2], 4096, 1)
    gather_slice_meta(desc[:, :0], i64[:0], i32[:0], u8[:0], i64[:0], 4096, 0)  # nothing


@pytest.mark.parametrize("segments", [1, 5, 200])  # 200: more than half the ring (uploaded)
def test_ramps_read_from_the_upload_ring_at_its_address(cuda, gen, segments):
    """The store's batched compress: the kernel reads the three numbers a segment from the
    page-locked ring at its address (no tensor made, once its first launch compiled it), and
    a table too large for the ring is uploaded; three calls, so the direct launch runs too."""
    from torch_pagecomp.offload._arena import UploadRing

    ring = UploadRing(slots=256)
    try:
        for _ in range(3):
            counts = [int(n) for n in torch.randint(0, 3000, (segments,), generator=gen)]
            counts[0] = max(counts[0], 1)
            bases = [int(b) * 4096 for b in torch.randint(1, 1 << 40, (segments,), generator=gen)]
            got = _decode.ramps(bases, counts, 4096, torch.device(cuda), ring)
            assert got.cpu().tolist() == _expected(bases, counts, 4096)
    finally:
        ring.release()
