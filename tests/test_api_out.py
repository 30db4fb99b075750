"""``compress(..., out=)`` and ``decompress(..., out=)``: the caller's tensors are written in
place (the kernels' own launch path on the GPU and under the interpreter, the C loops on the
host path; a copy only where no C loop runs), with the same bytes as a call that allocates, and
bad outputs refused with the problem named."""

import pytest
import torch
from conftest import POISON
from pages import bf16_exponent_pages, kernel_device, mixed_pages

import torch_pagecomp as pc
from torch_pagecomp import format as fmt

# (codec, element_size, pages maker, checksum); each case compresses its batch twice (without
# and with ``out``), so checksums are tried on two of them (the interpreter's time)
CASES = [
    ("lz4", 1, lambda gen, p: mixed_pages(9, p, gen), False),
    ("lz4", 2, lambda gen, p: bf16_exponent_pages(gen, p), True),
    ("lz4", 4, lambda gen, p: mixed_pages(5, p, gen), False),
    ("exp-bf16", None, lambda gen, p: bf16_exponent_pages(gen, p), True),
]


def _pages(make, gen, page_size: int, dev: str) -> torch.Tensor:
    """``make``'s pages on ``dev``: a random few of them under the interpreter (which pays
    per operation), all of them elsewhere."""
    pages = make(gen, page_size)
    if dev == "cpu" and kernel_device() == "cpu":
        pages = pages[torch.randperm(pages.shape[0], generator=gen)[:2]]
    return pages.contiguous().to(dev)


def _poisoned_like(c: fmt.CompressedPages, checksum: bool) -> fmt.CompressedPages:
    """A fixed-stride container of ``c``'s shapes whose every byte is poison."""
    def poison(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        out.view(torch.uint8).fill_(POISON)
        return out

    return fmt.CompressedPages(poison(c.payload), poison(c.sizes), poison(c.kinds),
                               c.page_size, checksums=poison(c.sizes) if checksum else None,
                               codec=c.codec)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("codec, element_size, make, checksum", CASES)
def test_compress_into_out_writes_its_tensors(gen, backend, codec, element_size, make,
                                              checksum):
    dev = kernel_device() if backend == "triton" else "cpu"
    page_size = 4096 if dev == "cpu" else 8192
    pages = _pages(make, gen, page_size, dev)
    want = pc.compress(pages, element_size=element_size, backend=backend, codec=codec,
                       checksum=checksum)
    out = _poisoned_like(want, checksum)
    got = pc.compress(pages, element_size=element_size, backend=backend, codec=codec,
                      checksum=checksum, out=out)
    for name in ("payload", "sizes", "kinds") + (("checksums",) if checksum else ()):
        assert getattr(got, name) is getattr(out, name), name  # written in place, not copied
    assert torch.equal(got.sizes, want.sizes) and torch.equal(got.kinds, want.kinds)
    if checksum:
        assert torch.equal(got.checksums, want.checksums)
    # whole rows: past its stored bytes a fixed-stride row is zero (the format), poison gone
    assert torch.equal(got.payload, want.payload)
    assert torch.equal(pc.decompress(got, backend=backend), pages)
    # a second batch of the same shape into the same tensors
    again = _pages(make, gen, page_size, dev)[:pages.shape[0]]
    again = torch.cat([again, pages[:pages.shape[0] - again.shape[0]]])
    got = pc.compress(again, element_size=element_size, backend=backend, codec=codec, out=out)
    assert torch.equal(pc.decompress(got, backend=backend), again)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("codec, element_size, make, checksum", CASES)
def test_decompress_into_out_writes_it(gen, backend, codec, element_size, make, checksum):
    dev = kernel_device() if backend == "triton" else "cpu"
    pages = _pages(make, gen, 4096, dev)
    # the host codec writes the same format (the interpreter's time goes to the decoder)
    c = pc.compress(pages.cpu(), element_size=element_size, backend="cpu", codec=codec,
                    checksum=checksum).to(dev)
    for packed in (False, True):
        cc = pc.pack(c) if packed else c
        out = torch.full_like(pages, POISON)
        got = pc.decompress(cc, backend=backend, out=out)
        assert got is out and torch.equal(out, pages)
        out.fill_(POISON)
        got, status = pc.decompress(cc, return_status=True, backend=backend, out=out)
        assert got is out and torch.equal(out, pages) and not status.any()


@pytest.mark.parametrize("loops", ["native", "python"])
@pytest.mark.parametrize("codec, element_size, make, checksum", CASES)
def test_host_path_writes_out_in_place(gen, monkeypatch, loops, codec, element_size, make,
                                       checksum):
    """On the host, ``out`` is where the codec writes: with the C loops no pooled output is
    taken (its pool refuses here) and nothing is copied over, on several threads too; without
    them (python-lz4 / the numpy reference) the same bytes arrive. Both directions, both
    codecs, fixed-stride and packed containers."""
    from torch_pagecomp import cpu_codec, exp_codec

    if loops == "native" and (cpu_codec._native is None or not exp_codec.NATIVE):
        pytest.skip("torch_pagecomp._native is not built here")
    pages = torch.cat([make(gen, 4096) for _ in range(12)])[:70]  # >= 64: threaded ranges
    pages = pages[torch.randperm(pages.shape[0], generator=gen)].contiguous()
    want = pc.compress(pages, element_size=element_size, backend="cpu", codec=codec,
                       checksum=checksum)
    packed = pc.pack(want)

    class NoPool:
        def empty(self, shape):
            raise AssertionError(f"a pooled output of {shape} was taken")

    if loops == "native":
        monkeypatch.setattr(cpu_codec, "_outputs", NoPool())
    else:
        monkeypatch.setattr(cpu_codec, "_native", None)
        monkeypatch.setattr(exp_codec, "NATIVE", False)
    pc.set_cpu_threads(2)
    try:
        out = _poisoned_like(want, checksum)
        got = pc.compress(pages, element_size=element_size, backend="cpu", codec=codec,
                          checksum=checksum, out=out)
        assert got.payload is out.payload and got.sizes is out.sizes and got.kinds is out.kinds
        assert torch.equal(got.payload, want.payload) and torch.equal(got.sizes, want.sizes)
        assert torch.equal(got.kinds, want.kinds)
        for cc in (want, packed):
            into = torch.full_like(pages, POISON)
            assert pc.decompress(cc, backend="cpu", out=into) is into
            assert torch.equal(into, pages)
    finally:
        pc.set_cpu_threads(None)


def test_decompress_into_out_any_codec_and_corrupt_pages(gen):
    dev = kernel_device()
    pages = bf16_exponent_pages(gen).to(dev)
    c = pc.compress(pages, codec="exp-bf16")
    out = torch.full_like(pages, POISON)
    assert pc.decompress(c, codec="any", out=out) is out and torch.equal(out, pages)
    bad = fmt.CompressedPages(c.payload, c.sizes.clone(), c.kinds, c.page_size, codec=c.codec)
    bad.sizes[2] = c.page_size + 1  # a size past the page: this page fails, the others decode
    out.fill_(POISON)
    got, status = pc.decompress(bad, return_status=True, out=out)
    assert status[2] != 0 and torch.equal(status.nonzero().flatten().cpu(), torch.tensor([2]))
    keep = torch.arange(pages.shape[0]) != 2
    assert torch.equal(got[keep.to(dev)], pages[keep.to(dev)])
    with pytest.raises(pc.CorruptPageError, match=r"\b2\b"):
        pc.decompress(bad, out=out)


def test_compress_out_errors_name_the_problem(gen):
    pages = mixed_pages(6, 4096, gen)[:6]
    before = pages.clone()
    c = pc.compress(pages, backend="cpu")
    exp = pc.compress(pages, backend="cpu", codec="exp-bf16")
    bad = [
        ("not a container", "out must be CompressedPages"),
        (pc.pack(c), "packed"),
        (pc.compress(pages[:5], backend="cpu"), "holds 5 pages of 4096 bytes, the input 6"),
        (pc.compress(pages.reshape(-1, 8192), backend="cpu"), "holds 3 pages of 8192 bytes"),
        (exp, "its codec is 'exp', this call's 'lz4'"),
        (fmt.CompressedPages(c.payload, c.sizes.long(), c.kinds, 4096), "sizes must be int32"),
        (fmt.CompressedPages(pages, c.sizes, c.kinds, 4096), "data and payload overlap"),
        (fmt.CompressedPages(c.payload, c.sizes, c.payload.view(-1)[:6], 4096),
         "payload and kinds overlap"),
    ]
    for out, message in bad:
        with pytest.raises(pc.PageCompError, match=message):
            pc.compress(pages, backend="cpu", out=out)
    assert torch.equal(pages, before)  # refused before anything was written


def test_decompress_out_errors_name_the_problem(gen):
    pages = mixed_pages(6, 4096, gen)[:6]
    c = pc.compress(pages, backend="cpu")
    bad = [
        ("bytes", "out must be a torch.Tensor"),
        (torch.empty((6, 4096), dtype=torch.int8), r"uint8 \[6, 4096\], got torch.int8"),
        (torch.empty((5, 4096), dtype=torch.uint8), r"got torch.uint8 \[5, 4096\]"),
        (torch.empty((4096, 6), dtype=torch.uint8).t(), "contiguous"),
        (torch.empty((6, 4096), dtype=torch.uint8, device="meta"), "is on meta"),
        (c.payload, "payload and out overlap"),
    ]
    for out, message in bad:
        with pytest.raises(pc.PageCompError, match=message):
            pc.decompress(c, backend="cpu", out=out)
    assert torch.equal(pc.decompress(c, backend="cpu"), pages)  # the input was not written
