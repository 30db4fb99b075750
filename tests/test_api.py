"""Public API: validation errors that name the problem, corrupt pages named, opcheck, backends."""

import os

import pytest
import torch
from pages import file_pages, mixed_pages
from torch.library import opcheck

import torch_pagecomp as pc
from torch_pagecomp import format as fmt


def test_compress_accepts_flat_bytes(gen):
    pages = file_pages("text", 4, 8192, gen)
    c = pc.compress(pages.view(-1), page_size=8192)
    assert c.page_size == 8192 and c.num_pages == 4
    assert torch.equal(pc.decompress(c), pages)
    c = pc.compress(pages.view(-1))  # default page size
    assert c.page_size == 4096 and c.num_pages == 8


@pytest.mark.parametrize(
    "data, kwargs, message",
    [
        (torch.zeros((2, 4096), dtype=torch.float32), {}, "dtype torch.uint8"),
        (torch.zeros((2, 2, 4096), dtype=torch.uint8), {}, "2-D"),
        (torch.zeros(5000, dtype=torch.uint8), {}, "whole number of 4096-byte pages"),
        (torch.zeros((2, 4096), dtype=torch.uint8), {"page_size": 8192}, "page_size=8192"),
        (torch.zeros((2, 2048), dtype=torch.uint8), {}, "power of two"),
        (torch.zeros((2, 131072), dtype=torch.uint8), {}, "power of two"),
        (torch.zeros((2, 6144), dtype=torch.uint8), {}, "power of two"),
        (torch.zeros(8192, dtype=torch.uint8), {"page_size": 5000}, "power of two"),
        (torch.zeros((4096, 2), dtype=torch.uint8).t(), {}, "contiguous"),
        (torch.zeros((2, 4096), dtype=torch.uint8), {"element_size": 3}, "element_size"),
        # True == 1 in Python; the ops refuse it, so the public call (their only check on the
        # direct launch path) does too
        (torch.zeros((2, 4096), dtype=torch.uint8), {"element_size": True}, "element_size"),
        (torch.zeros((2, 4096), dtype=torch.uint8), {"backend": "gpu"}, "backend"),
        # unhashable settings: named as any other bad one (not a TypeError from a plan's key)
        (torch.zeros((2, 4096), dtype=torch.uint8), {"backend": ["cpu"]}, "backend"),
        (torch.zeros((2, 4096), dtype=torch.uint8), {"codec": ["lz4"]}, "codec"),
        ([1, 2, 3], {}, "torch.Tensor"),
    ],
)
def test_compress_errors_name_the_problem(data, kwargs, message):
    with pytest.raises(pc.PageCompError, match=message):
        pc.compress(data, **kwargs)


def test_decompress_errors_name_the_problem(gen):
    c = pc.compress(mixed_pages(7, 4096, gen))
    bad = [
        (fmt.CompressedPages(c.payload, c.sizes.long(), c.kinds, 4096), "sizes must be int32"),
        (fmt.CompressedPages(c.payload, c.sizes, c.kinds[:-1], 4096), "kinds must be uint8"),
        (fmt.CompressedPages(c.payload.float(), c.sizes, c.kinds, 4096), "payload dtype"),
        (fmt.CompressedPages(c.payload, c.sizes, c.kinds, 8192), "fixed-stride payload"),
        (fmt.CompressedPages(c.payload, c.sizes, c.kinds, 1000), "power of two"),
        (
            # (the one other device a CPU-only run has: named as such before the devices
            # are compared; test_validation covers tensors on different real devices)
            fmt.CompressedPages(c.payload, c.sizes.to("meta"), c.kinds, 4096),
            "sizes is on the meta device",
        ),
        (
            fmt.CompressedPages(c.payload.view(-1), c.sizes, c.kinds, 4096, c.sizes.long()),
            "offsets must be int64",
        ),
    ]
    for container, message in bad:
        with pytest.raises(pc.PageCompError, match=message):
            pc.decompress(container)
    with pytest.raises(pc.PageCompError, match="CompressedPages"):
        pc.decompress(c.payload)


def test_corrupt_pages_are_named(gen):
    pages = file_pages("text", 6, 4096, gen)
    c = pc.pack(pc.compress(pages))
    payload, sizes, kinds = c.payload.clone(), c.sizes.clone(), c.kinds.clone()
    o = c.offsets
    payload[o[1] : o[2]] = 0xFF  # every length extends forever: truncated
    sizes[3] = 2  # block cut short
    kinds[4] = 0x37  # unknown kind
    broken = pc.CompressedPages(payload, sizes, kinds, 4096, c.offsets)
    with pytest.raises(pc.CorruptPageError) as info:
        pc.decompress(broken)
    assert info.value.pages == [1, 3, 4]
    assert "bad kind" in str(info.value)
    out, status = pc.decompress(broken, return_status=True)
    assert status.tolist()[0] == 0 and status.tolist()[2] == 0 and status.tolist()[5] == 0
    for i in (0, 2, 5):
        assert torch.equal(out[i], pages[i])
    assert not out[[1, 3, 4]].any(), "failed pages must be zero-filled"


def test_hostile_metadata_never_crashes(gen):
    c = pc.pack(pc.compress(mixed_pages(7, 4096, gen)))
    n = c.num_pages
    sizes = torch.randint(-5, 70000, (n,), dtype=torch.int32, generator=gen)
    kinds = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    offsets = torch.randint(-100, c.payload.numel() + 100, (n + 1,), generator=gen)
    out, status = pc.decompress(
        pc.CompressedPages(c.payload, sizes, kinds, 4096, offsets), return_status=True
    )
    assert out.shape == (n, 4096) and status.shape == (n,)
    assert set(status.tolist()) <= set(fmt.STATUS_NAMES)


def test_opcheck_every_op(gen):
    pages = mixed_pages(7, 4096, gen)
    c = pc.compress(pages)
    packed = pc.pack(c)
    cases = [
        (torch.ops.pagecomp.compress.default, (pages, 1)),
        (torch.ops.pagecomp.compress.default, (pages, 2)),
        (torch.ops.pagecomp.pack.default, (c.payload, c.sizes)),
        (
            torch.ops.pagecomp.decompress.default,
            (packed.payload, packed.page_offsets(), c.sizes, c.kinds, 4096),
        ),
    ]
    for op, args in cases:
        opcheck(op, args)


def test_fake_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        pages = torch.empty((10, 8192), dtype=torch.uint8)
        payload, sizes, kinds = torch.ops.pagecomp.compress(pages, 2)
        assert payload.shape == (10, 8192) and sizes.dtype == torch.int32
        assert kinds.dtype == torch.uint8
        out, status = torch.ops.pagecomp.decompress(
            payload.view(-1), torch.empty(10, dtype=torch.int64), sizes, kinds, 8192
        )
        assert out.shape == (10, 8192) and status.shape == (10,)


def test_gpu_status_and_backend_choice():
    status = pc.gpu_status()
    assert isinstance(status.usable, bool) and status.reason
    if not torch.cuda.is_available():
        assert not status.usable
        assert pc.select_backend(10_000, "cpu") == "cpu"
        assert pc.select_backend(1, "cuda") == "cpu-served"
    else:
        assert pc.select_backend(1, "cpu") == "cpu"


def test_ratio_and_sizes(gen):
    pages = torch.cat([torch.zeros((3, 4096), dtype=torch.uint8), file_pages("text", 3, 4096, gen)])
    c = pc.compress(pages)
    assert c.compressed_nbytes() == int(c.sizes.sum())
    assert c.ratio() > 3


def test_cpu_eager_calls_skip_the_dispatch_traced_calls_see_the_ops(gen, monkeypatch):
    """Eager calls on the CPU path run the reference codec once the public API has checked
    the arguments, without the ops' dispatch or their eager entries (whose argument checks
    would run again: counted here), and give the ops' results, for both codecs; under
    ``make_fx`` (a dispatch mode) the graph holds the ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_pagecomp import _ops

    n = int(torch.randint(1, 40, (1,), generator=gen))
    pages = torch.cat([mixed_pages(n, 4096, gen),
                       torch.randn(n * 2048, generator=gen).to(torch.bfloat16)
                       .view(torch.uint8).view(n, 4096)])
    calls = []

    def counted(check):
        return lambda *a, **k: calls.append(1) or check(*a, **k)

    for name in ("check_compress_args", "check_decompress_args"):
        monkeypatch.setattr(fmt, name, counted(getattr(fmt, name)))
    for e, codec in ((1, "lz4"), (2, "lz4"), (None, "exp-bf16")):
        calls.clear()
        c = pc.compress(pages, element_size=e, backend="cpu", codec=codec)
        back, status = pc.decompress(c, return_status=True, backend="cpu")
        assert not calls, "an eager CPU call checked its arguments again (an op or its entry)"
        ref = (torch.ops.pagecomp.compress(pages, e) if codec == "lz4"
               else torch.ops.pagecomp.compress_exp(pages, "bf16"))
        for a, b in zip((c.payload, c.sizes, c.kinds), ref):
            assert torch.equal(a, b)
        assert not status.any() and torch.equal(back, pages)
        packed = pc.pack(c)
        assert torch.equal(pc.decompress(packed, backend="cpu"), pages)
    assert torch.equal(_ops.checksum_eager(pages), torch.ops.pagecomp.checksum(pages))
    graph = make_fx(lambda x: pc.decompress(pc.compress(x, backend="cpu"), return_status=True,
                                            backend="cpu"))(pages)
    assert "pagecomp.compress" in graph.code and "pagecomp.decompress" in graph.code, graph.code


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs CUDA")
def test_gpu_eager_calls_launch_directly_traced_calls_see_the_ops(gen):
    """Eager calls on CUDA tensors skip the operator dispatch and give the ops' results; under
    ``make_fx`` (a dispatch mode) the graph holds the ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    pages = mixed_pages(600, 4096, gen).cuda()
    for e in (1, 2):
        c = pc.compress(pages, element_size=e)
        ref = torch.ops.pagecomp.compress(pages, e)
        for a, b in zip((c.payload, c.sizes, c.kinds), ref):
            assert torch.equal(a, b)
        back, status = pc.decompress(c, return_status=True)
        assert not status.any() and torch.equal(back, pages)
    graph = make_fx(lambda x: pc.decompress(pc.compress(x), return_status=True))(pages)
    code = graph.code
    assert "pagecomp.compress" in code and "pagecomp.decompress" in code, code
