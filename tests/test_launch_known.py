"""The activation store's known-classes launchers (``*_known``, and ``*_at``, which take
addresses) launch exactly what the kernels' own launchers launch: the same kernel, grid,
settings object and arguments, with the argument classes the direct path would compute
(``launch._arg_class``), so a cached compiled kernel is only ever reused for the arguments it
was compiled for. On the CPU both sides are captured instead of launched; the GPU tests run
them for real."""

import pytest
import torch

from torch_pagecomp.kernels import exp_codec as X
from torch_pagecomp.kernels import host_pack as H
from torch_pagecomp.kernels import launch as L
from torch_pagecomp.kernels import lz4_compress as C
from torch_pagecomp.kernels import lz4_decompress as D
from torch_pagecomp.kernels import row_table as R

P = 4096


@pytest.fixture(params=[False, True], ids=["gpu-settings", "interpreter-settings"])
def interpret(request):
    """Both sides pick the settings of the GPU, then of the interpreter (the same ones)."""
    return request.param


def _capture(monkeypatch, modules, interpret):
    """Record each module's ``launch`` (the usual path) and ``launch_known`` calls."""
    usual, known = [], []
    for mod in modules:
        if hasattr(mod, "interpreting"):
            monkeypatch.setattr(mod, "interpreting", lambda: interpret)
        monkeypatch.setattr(mod, "launch", lambda kernel, grid, device, args, meta, traced=True:
                            usual.append((kernel, tuple(grid), args, meta)))
        if hasattr(mod, "launch_known"):
            monkeypatch.setattr(mod, "launch_known",
                                lambda kernel, grid, index, meta, classes, values, args,
                                stream=None: known.append((kernel, tuple(grid),
                                                           args() if callable(args) else args,
                                                           meta, classes, values)))
    return usual, known


def _same(usual, known):
    assert len(usual) == len(known) >= 1
    for (k1, g1, a1, m1), (k2, g2, a2, m2, classes, values) in zip(usual, known):
        assert k1 is k2 and g1 == g2 and m1 is m2
        assert len(a1) == len(a2) and all(
            x is y if isinstance(x, torch.Tensor) else x == y for x, y in zip(a1, a2))
        assert classes == tuple(L._arg_class(a) for a in a1)
        for a, v in zip(a1, values):  # a tensor goes as its address (or itself: host memory)
            assert (v is a or v == a.data_ptr()) if isinstance(a, torch.Tensor) else v == a


def _tensors(gen, n, offset=0):
    pages = torch.randint(0, 256, (n * P + offset,), dtype=torch.uint8, generator=gen)
    pages = pages[offset:].view(n, P)
    out = (torch.empty((n, P), dtype=torch.uint8), torch.empty(n, dtype=torch.int32),
           torch.empty(n, dtype=torch.uint8))
    return pages, out


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("fp16", [False, True])
def test_compress_exp_placed_at(monkeypatch, gen, fp16, rows, interpret):
    pages, out = _tensors(gen, 5)
    src = (torch.tensor([pages.data_ptr() + i * P for i in range(5)], dtype=torch.int64)
           if rows else pages)
    outs = (out[0].view(-1), out[1], out[2], torch.empty(5, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64))
    usual, known = _capture(monkeypatch, [X], interpret)
    X.compress_exp_placed(src, fp16, outs, page_size=P)
    X.compress_exp_placed_at(src.device.index, 5, P, fp16, rows,
                             tuple(t.data_ptr() for t in (src, *outs)), (src, *outs))
    _same(usual, known)


def test_place_slice_at(monkeypatch, interpret):
    end, ends, desc, host = (torch.zeros(k, dtype=torch.int64) for k in (1, 2, 2, 4))
    usual, known = _capture(monkeypatch, [H], interpret)
    H.place_slice(end, ends, 1, 1 << 20, desc, host, 1 << 16, 48)
    H.place_slice_at(None, None, tuple(t.data_ptr() for t in (end, ends, desc, host)), 1,
                     1 << 20, 48, 1 << 16, (end, ends, desc, host, 1, 1 << 20, 48))
    _same(usual, known)


@pytest.mark.parametrize("n", [1, 16, 37])
@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_compress_at(monkeypatch, gen, n, element_size, interpret):
    monkeypatch.setattr(C, "_sm_count", lambda index: 7)  # as if on a 7-SM GPU
    monkeypatch.setattr(C, "_sm_programs", lambda device, k: 3 if interpret else 7 * k)
    pages, out = _tensors(gen, n, 8)  # 8-aligned: the narrow shuffle setting
    cfg = C.compress_config(P, element_size)
    scratch = C.compress_scratch(torch.device("cpu"), cfg, C.max_programs(None, cfg))
    usual, known = _capture(monkeypatch, [C], interpret)
    C.compress_pages(pages, element_size, traced=False, out=out, scratch=scratch)
    programs, metas = C.known_settings(pages.device, cfg)  # as the activation store keeps
    args = (pages, *out, *scratch)
    C.compress_at(pages.device.index, min(n, programs), n,
                  metas[pages.storage_offset() % 8 == 0], tuple(t.data_ptr() for t in args),
                  lambda: (*args, n))
    _same(usual, known)


@pytest.mark.parametrize("parity, limit", [(0, 64 << 20), (1, 5 << 30)])
def test_pack_slice_at(monkeypatch, gen, parity, limit, interpret):
    payload, (_, sizes, _) = _tensors(gen, 3)
    rel, ends, desc = (torch.empty(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                       torch.empty(2, dtype=torch.int64))
    host_desc, table = torch.empty(2, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
    meta = torch.empty(80, dtype=torch.uint8)
    usual, known = _capture(monkeypatch, [H], interpret)
    args = (payload, sizes, rel, ends, parity, limit, desc, host_desc, table, 64 << 20, meta, 32)
    H.pack_slice(*args)
    tensors = (payload, sizes, rel, ends, desc, host_desc, table, meta)
    H.pack_slice_at(payload.device.index, None, min(3, H.link_programs(payload.device)), 3, P,
                    64 << 20, tuple(t.data_ptr() for t in tensors), table.numel(), parity,
                    limit, (80, 32), tensors + (3, parity, limit, 80, 32))
    _same(usual, known)


@pytest.mark.parametrize("stride", [0, P])
def test_fill_row_table_at(monkeypatch, stride, interpret):
    desc = torch.tensor([[1 << 20, 2 << 20], [0, 3], [3, 2000]], dtype=torch.int64)
    rows = torch.empty(2003, dtype=torch.int64)
    usual, known = _capture(monkeypatch, [R], interpret)
    R.fill_row_table(desc, rows, stride, 2000, traced=False)
    R.fill_row_table_at(None, 2, stride, 2000, (desc.data_ptr(), rows.data_ptr()),
                        (desc, rows, 2))
    _same(usual, known)


def test_gather_slice_meta_at(monkeypatch, interpret):
    desc = torch.zeros((R.SLICE_DESC_ROWS, 3), dtype=torch.int64)
    outs = (torch.empty(40, dtype=torch.int64), torch.empty(40, dtype=torch.int32),
            torch.empty(40, dtype=torch.uint8), torch.empty(40, dtype=torch.int64))
    usual, known = _capture(monkeypatch, [R], interpret)
    R.gather_slice_meta(desc, *outs, P, 2100, traced=False)
    R.gather_slice_meta_at(None, 3, 2100, P, tuple(t.data_ptr() for t in (desc, *outs)),
                           (desc, *outs, 3))
    _same(usual, known)


@pytest.mark.parametrize("with_offsets", [True, False])
def test_decoders_known(monkeypatch, gen, with_offsets, interpret):
    n = 6
    payload = torch.randint(0, 256, (n * P,), dtype=torch.uint8, generator=gen)
    offsets = torch.arange(n, dtype=torch.int64) * P if with_offsets else None
    sizes, kinds = torch.full((n,), P, dtype=torch.int32), torch.zeros(n, dtype=torch.uint8)
    pages, status = torch.empty((n, P), dtype=torch.uint8), torch.empty(n, dtype=torch.int32)
    rows = torch.arange(n, dtype=torch.int64) * P + (1 << 30)
    usual, known = _capture(monkeypatch, [D, X], interpret)
    D.decompress_into(payload, offsets, sizes, kinds, pages, status, traced=False)
    D.decompress_rows(payload, offsets, sizes, kinds, rows, P, status)
    X.decompress_exp_into(payload, offsets, sizes, kinds, pages, status, traced=False)
    X.decompress_exp_rows(payload, offsets, sizes, kinds, rows, P, status)
    # the LZ4 decoders' known launches go through ``lz4_decompress.launch_known`` whichever
    # module calls ``decode_known``
    D.decompress_into_known(payload, offsets, sizes, kinds, pages, status)
    D.decompress_rows_known(payload, offsets, sizes, kinds, rows, P, status)
    X.decompress_exp_into_known(payload, offsets, sizes, kinds, pages, status)
    X.decompress_exp_rows_known(payload, offsets, sizes, kinds, rows, P, status)
    _same(usual, known)


def test_row_decoders_by_address(monkeypatch, gen, interpret):
    """The batched restore's decoders given addresses launch what the usual launchers do."""
    n = 5
    payload = torch.randint(0, 256, (n * P + 8,), dtype=torch.uint8, generator=gen)[8:]
    offsets = torch.arange(n, dtype=torch.int64) * P
    sizes, kinds = torch.full((n,), P, dtype=torch.int32), torch.zeros(n, dtype=torch.uint8)
    status = torch.empty(n, dtype=torch.int32)
    rows = torch.arange(n, dtype=torch.int64) * P + (1 << 30)
    usual, known = _capture(monkeypatch, [D, X], interpret)
    D.decompress_rows(payload, offsets, sizes, kinds, rows, P, status)
    X.decompress_exp_rows(payload, offsets, sizes, kinds, rows, P, status)
    args = (payload, offsets, sizes, kinds, rows, status, payload.numel())
    addrs = tuple(t.data_ptr() for t in args[:6])
    D.decompress_rows_at(None, P, n, addrs, payload.numel(), lambda: args)
    X.decompress_exp_rows_at(None, P, n, addrs, payload.numel(), args)
    _same(usual, known)


def test_launch_known_falls_back_until_the_classes_are_compiled(monkeypatch):
    """Before a launch of these classes compiled and cached the kernel (and on another device,
    or with Triton's launch hooks set) ``launch_known`` takes the usual path with the tensors."""
    calls = []
    monkeypatch.setattr(L, "launch", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(L.torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    meta = L.frozen_meta((("BLOCK", 64),))
    args = (torch.zeros(4), 3)
    L.launch_known(object(), (2,), 0, meta, ("c",), (1, 3), args)
    assert len(calls) == 1 and calls[0][0][1] == (2,) and calls[0][0][3] is args
    assert calls[0][1] == {"traced": False}
