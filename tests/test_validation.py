"""Issue #20: arguments are validated before any kernel runs, untrusted metadata never moves an
access outside the tensors of the call, and the Triton decoder agrees with the CPU path on
mutated pages of every kind, page size and element size.

* Every public op (``torch.ops.pagecomp.compress / decompress / pack``) and eager entry point
  (``_ops.*_eager``) raises ``PageCompError`` naming the problem for bad shapes, dtypes,
  strides, devices and page sizes, with no kernel (or CPU codec) call, also under fake tensors.
* The decoder, run by the CPU interpreter with every masked load and store checked against the
  tensors of the call (``test_bounds.bounds``), on the reported 32-bit position wrap and on
  pages past 2 GiB of payload.
* A differential fuzz: valid pages (RAW, FILL, LZ4, shuffled LZ4), mutated (byte flips,
  overwrites, truncations, size changes, offset-0 matches, kind and offset changes), decoded by
  the Triton kernels and by ``cpu_codec.decompress_cpu``: the same statuses and bytes, and both
  equal to the format's rules (``decode_block`` deciding the blocks).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import random  # noqa: E402

import lz4.block  # noqa: E402
import pytest  # noqa: E402
from conftest import POISON  # noqa: E402
from pages import periodic_pages, run_pages  # noqa: E402
from test_bounds import bounds  # noqa: E402, F401  (the fixture)

import torch_pagecomp as pc  # noqa: E402
from torch_pagecomp import _ops, cpu_codec  # noqa: E402
from torch_pagecomp import format as fmt  # noqa: E402
from torch_pagecomp.kernels import lz4_compress, lz4_decompress  # noqa: E402
from torch_pagecomp.kernels import pack as kpack  # noqa: E402
from torch_pagecomp.shuffle import bitunshuffle  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="CPU interpreter tests")
P = 4096
N = 3


# ------------------------------------------------------------------ argument validation
@pytest.fixture
def no_kernels(monkeypatch):
    """Fail if any kernel launcher or CPU codec function runs."""

    def ran(*a, **k):
        raise AssertionError("a kernel or codec ran on invalid arguments")

    for mod, name in [(cpu_codec, "compress_cpu"), (cpu_codec, "decompress_cpu"),
                      (cpu_codec, "pack_cpu"), (lz4_compress, "compress_pages"),
                      (lz4_decompress, "decompress_pages"), (lz4_decompress, "decompress_into"),
                      (kpack, "pack_pages")]:
        monkeypatch.setattr(mod, name, ran)


def _dec_args():
    return dict(payload=torch.zeros(N * P, dtype=torch.uint8),
                offsets=torch.arange(N, dtype=torch.int64) * P,
                sizes=torch.ones(N, dtype=torch.int32),
                kinds=torch.full((N,), fmt.KIND_FILL, dtype=torch.uint8),
                page_size=P)


def _strided(dtype, n):
    return torch.zeros(2 * n, dtype=dtype)[::2]


DECOMPRESS_CASES = {
    "offsets shorter than sizes": ("offsets", lambda a: a["offsets"][:-1],
                                   r"offsets must be torch.int64 \[3\], got torch.int64 \[2\]"),
    "kinds shorter than sizes": ("kinds", lambda a: a["kinds"][:-1],
                                 r"kinds must be torch.uint8 \[3\], got torch.uint8 \[2\]"),
    "offsets int32": ("offsets", lambda a: a["offsets"].int(), r"offsets must be torch.int64"),
    "sizes int64": ("sizes", lambda a: a["sizes"].long(), r"sizes must be torch.int32"),
    "kinds int8": ("kinds", lambda a: a["kinds"].to(torch.int8), r"kinds must be torch.uint8"),
    "sizes 2-D": ("sizes", lambda a: a["sizes"].view(1, N), r"sizes must be torch.int32 \[\*\]"),
    "payload 2-D": ("payload", lambda a: a["payload"].view(N, P), r"payload must be torch.uint8"),
    "payload float": ("payload", lambda a: a["payload"].view(torch.float32), r"payload must be"),
    "payload strided": ("payload", lambda a: _strided(torch.uint8, N * P),
                        r"payload must be contiguous"),
    "offsets expanded": ("offsets", lambda a: torch.zeros(1, dtype=torch.int64).expand(N),
                         r"offsets must be contiguous.*strides \[0\]"),
    "sizes strided": ("sizes", lambda a: _strided(torch.int32, N), r"sizes must be contiguous"),
    "kinds strided": ("kinds", lambda a: _strided(torch.uint8, N), r"kinds must be contiguous"),
    "page size 5000": ("page_size", lambda a: 5000, r"page_size must be a power of two"),
    "page size 2048": ("page_size", lambda a: 2048, r"page_size must be a power of two"),
    "page size 131072": ("page_size", lambda a: 131072, r"page_size must be a power of two"),
    "sizes on another device": ("sizes", lambda a: a["sizes"].to("meta"),
                                r"different devices.*sizes on meta"),
    "offsets not a tensor": ("offsets", lambda a: [0, P, 2 * P],
                             r"offsets must be a torch.Tensor"),
}


def _raises(fn, message: str):
    """``PageCompError`` matching ``message``; the dispatcher of an op itself refuses a
    non-tensor where its schema says Tensor (a RuntimeError, before the op's code runs)."""
    if "torch.Tensor" in message and isinstance(fn, torch._ops.OpOverloadPacket):
        return pytest.raises(RuntimeError, match="Expected a value of type 'Tensor'")
    return pytest.raises(pc.PageCompError, match=message)


@pytest.mark.parametrize("case", DECOMPRESS_CASES)
def test_decompress_ops_name_the_problem(case, no_kernels):
    key, make, message = DECOMPRESS_CASES[case]
    a = _dec_args()
    a[key] = make(a)
    args = (a["payload"], a["offsets"], a["sizes"], a["kinds"], a["page_size"])
    for fn in (torch.ops.pagecomp.decompress, _ops.decompress_eager,
               torch.ops.pagecomp.decompress_reference):
        with _raises(fn, message):
            fn(*args)
    if key != "page_size":
        out = torch.empty((N, P), dtype=torch.uint8)
        status = torch.empty(N, dtype=torch.int32)
        with pytest.raises(pc.PageCompError, match=message):
            _ops.decompress_into_eager(*args[:4], out, status)


DECOMPRESS_INTO_CASES = {
    "status shorter than sizes": ("status", lambda: torch.empty(N - 1, dtype=torch.int32),
                                  r"status must be torch.int32 \[3\], got torch.int32 \[2\]"),
    "status int64": ("status", lambda: torch.empty(N, dtype=torch.int64),
                     r"status must be torch.int32"),
    "status strided": ("status", lambda: _strided(torch.int32, N), r"status must be contiguous"),
    "pages fewer rows": ("pages", lambda: torch.empty((N - 1, P), dtype=torch.uint8),
                         r"pages must be torch.uint8 \[3, 4096\]"),
    "pages transposed": ("pages", lambda: torch.empty((P, N), dtype=torch.uint8).t(),
                         r"pages must be contiguous"),
    "pages expanded": ("pages", lambda: torch.empty((1, P), dtype=torch.uint8).expand(N, P),
                       r"pages must be contiguous.*strides \[0, 1\]"),
    "pages int16": ("pages", lambda: torch.empty((N, P // 2), dtype=torch.int16),
                    r"page_size must be a power of two"),
    "pages 1-D": ("pages", lambda: torch.empty(N * P, dtype=torch.uint8),
                  r"pages must be uint8 \[N, P\]"),
    "pages of 5000 bytes": ("pages", lambda: torch.empty((N, 5000), dtype=torch.uint8),
                            r"page_size must be a power of two.*got 5000"),
    "status on another device": ("status", lambda: torch.empty(N, dtype=torch.int32,
                                                               device="meta"),
                                 r"different devices.*status on meta"),
}


@pytest.mark.parametrize("case", DECOMPRESS_INTO_CASES)
def test_decompress_into_checks_its_outputs(case, no_kernels):
    key, make, message = DECOMPRESS_INTO_CASES[case]
    a = _dec_args()
    outs = dict(pages=torch.empty((N, P), dtype=torch.uint8),
                status=torch.empty(N, dtype=torch.int32))
    outs[key] = make()
    with pytest.raises(pc.PageCompError, match=message):
        _ops.decompress_into_eager(a["payload"], a["offsets"], a["sizes"], a["kinds"],
                                   outs["pages"], outs["status"])


COMPRESS_CASES = {
    "expanded (stride 0)": (lambda: torch.zeros((1, P), dtype=torch.uint8).expand(4, P), 1,
                            r"pages must be contiguous.*strides \[0, 1\]"),
    "transposed": (lambda: torch.zeros((P, 2), dtype=torch.uint8).t(), 1,
                   r"pages must be contiguous"),
    "every other row": (lambda: torch.zeros((4, P), dtype=torch.uint8)[::2], 1,
                        r"pages must be contiguous"),
    "float": (lambda: torch.zeros((2, P), dtype=torch.float32), 1, r"pages must be torch.uint8"),
    "1-D": (lambda: torch.zeros(2 * P, dtype=torch.uint8), 1,
            r"pages must be torch.uint8 \[\*, \*\]"),
    "3-D": (lambda: torch.zeros((2, 2, P), dtype=torch.uint8), 1, r"pages must be torch.uint8"),
    "page size 2048": (lambda: torch.zeros((2, 2048), dtype=torch.uint8), 1, r"power of two"),
    "page size 6144": (lambda: torch.zeros((2, 6144), dtype=torch.uint8), 1, r"power of two"),
    "page size 131072": (lambda: torch.zeros((1, 131072), dtype=torch.uint8), 1, r"power of two"),
    "element size 3": (lambda: torch.zeros((2, P), dtype=torch.uint8), 3, r"element_size"),
    "element size 8": (lambda: torch.zeros((2, P), dtype=torch.uint8), 8, r"element_size"),
    "not a tensor": (lambda: [[0] * P], 1, r"pages must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", COMPRESS_CASES)
def test_compress_ops_name_the_problem(case, no_kernels):
    make, element_size, message = COMPRESS_CASES[case]
    for fn in (torch.ops.pagecomp.compress, _ops.compress_eager,
               torch.ops.pagecomp.compress_reference):
        with _raises(fn, message):
            fn(make(), element_size)


PACK_CASES = {
    "payload 1-D": (lambda p, s: (p.view(-1), s), r"payload must be torch.uint8 \[\*, \*\]"),
    "payload of 5000-byte rows": (lambda p, s: (torch.zeros((N, 5000), dtype=torch.uint8), s),
                                  r"page size\) must be a power of two"),
    "payload expanded": (lambda p, s: (p[:1].expand(N, P), s), r"payload must be contiguous"),
    "payload float": (lambda p, s: (p.view(torch.float32), s), r"payload must be torch.uint8"),
    "sizes int64": (lambda p, s: (p, s.long()), r"sizes must be torch.int32"),
    "sizes shorter": (lambda p, s: (p, s[:-1]), r"sizes must be torch.int32 \[3\]"),
    "sizes strided": (lambda p, s: (p, _strided(torch.int32, N)), r"sizes must be contiguous"),
    "sizes on another device": (lambda p, s: (p, s.to("meta")), r"different devices"),
}


@pytest.mark.parametrize("case", PACK_CASES)
def test_pack_ops_name_the_problem(case, no_kernels):
    make, message = PACK_CASES[case]
    args = make(torch.zeros((N, P), dtype=torch.uint8), torch.ones(N, dtype=torch.int32))
    for fn in (torch.ops.pagecomp.pack, _ops.pack_eager, torch.ops.pagecomp.pack_reference):
        with pytest.raises(pc.PageCompError, match=message):
            fn(*args)


def test_checks_run_on_fake_tensors_and_trace():
    """The checks read only shapes, dtypes, strides and devices: under fake tensors the bad
    calls still raise, and ``make_fx`` traces the good ones with symbolic shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        a = _dec_args()
        with pytest.raises(pc.PageCompError, match="offsets must be torch.int64"):
            torch.ops.pagecomp.decompress(a["payload"], a["offsets"][:-1], a["sizes"],
                                          a["kinds"], P)
        with pytest.raises(pc.PageCompError, match="pages must be contiguous"):
            torch.ops.pagecomp.compress(torch.empty((1, P), dtype=torch.uint8).expand(3, P), 1)
        with pytest.raises(pc.PageCompError, match="sizes must be torch.int32"):
            torch.ops.pagecomp.pack(torch.empty((N, P), dtype=torch.uint8),
                                    torch.empty(N, dtype=torch.int64))

    def roundtrip(pages):
        payload, sizes, kinds = torch.ops.pagecomp.compress(pages, 2)
        packed, offsets = torch.ops.pagecomp.pack(payload, sizes)
        return torch.ops.pagecomp.decompress(packed, offsets[:-1], sizes, kinds, pages.shape[1])

    pages = torch.zeros((5, 8192), dtype=torch.uint8)
    for mode in ("fake", "symbolic"):
        code = make_fx(roundtrip, tracing_mode=mode)(pages).code
        assert "pagecomp.compress" in code and "pagecomp.decompress" in code, code


def test_eager_entry_points_on_meta_tensors_do_what_the_ops_do():
    """Meta tensors pass the argument checks (they read no values): each op gives meta
    outputs of its shapes (its fake implementation), and so must the eager entry point that is
    "as" the op, not run the host codec on tensors without bytes (NotImplementedError)."""
    m = dict(device="meta")
    pages = torch.empty((N, P), dtype=torch.uint8, **m)
    dec = (torch.empty(N * P, dtype=torch.uint8, **m), torch.empty(N, dtype=torch.int64, **m),
           torch.empty(N, dtype=torch.int32, **m), torch.empty(N, dtype=torch.uint8, **m), P)
    calls = [
        (torch.ops.pagecomp.compress, _ops.compress_eager, (pages, 1)),
        (torch.ops.pagecomp.compress_exp, _ops.compress_exp_eager, (pages, "bf16")),
        (torch.ops.pagecomp.checksum, _ops.checksum_eager, (pages,)),
        (torch.ops.pagecomp.pack, _ops.pack_eager, (pages, dec[2])),
        (torch.ops.pagecomp.decompress, _ops.decompress_eager, dec),
        (torch.ops.pagecomp.decompress_exp, _ops.decompress_exp_eager, dec),
    ]
    for op, eager, args in calls:
        def kinds(out):
            out = (out,) if torch.is_tensor(out) else out
            return [(t.device.type, t.dtype, t.shape) for t in out]

        assert kinds(eager(*args)) == kinds(op(*args)), op
    _ops.decompress_into_eager(*dec[:4], torch.empty((N, P), dtype=torch.uint8, **m),
                               torch.empty(N, dtype=torch.int32, **m))


def test_packed_offsets_disagreeing_with_sizes_are_named(gen):
    """``api.decompress`` of a packed container: a page whose ``offsets[i + 1] - offsets[i]``
    is not its size (or ``offsets[0] != 0``) fails with ``STATUS_BAD_SIZE`` and is named;
    ``ratio()`` counts ``sizes``, not ``offsets[-1]``."""
    pages = torch.cat([periodic_pages(int(torch.randint(1, 30, (1,), generator=gen)), 3, P, gen),
                       torch.zeros((2, P), dtype=torch.uint8)])
    c = pc.pack(pc.compress(pages, backend="cpu"))
    assert c.ratio() == pytest.approx(5 * P / int(c.sizes.sum()))
    offsets = c.offsets.clone()
    offsets[2] += 1  # page 1 one byte longer, page 2 one shorter
    offsets[-1] = 10**12  # the last page claims more than the payload holds
    broken = pc.CompressedPages(c.payload, c.sizes, c.kinds, P, offsets)
    assert broken.ratio() == c.ratio()
    for backend in ("cpu", "triton") if INTERPRET else ("cpu",):
        out, status = pc.decompress(broken, return_status=True, backend=backend)
        assert status.tolist() == [0, 2, 2, 0, 2], backend
        assert torch.equal(out[[0, 3]], pages[[0, 3]]) and not out[[1, 2, 4]].any()
        with pytest.raises(pc.CorruptPageError, match="offsets\\[i \\+ 1\\] - offsets") as info:
            pc.decompress(broken, backend=backend)
        assert info.value.pages == [1, 2, 4]
    shifted = c.offsets + 1  # every page consistent but page 0 does not start at 0
    out, status = pc.decompress(pc.CompressedPages(torch.cat([c.payload[:1], c.payload]),
                                                   c.sizes, c.kinds, P, shifted),
                                return_status=True, backend="cpu")
    assert status.tolist() == [2, 0, 0, 0, 0]


# ------------------------------------------------------------------ 64-bit positions
def _outs(n: int, page_size: int = P, misalign: int = 0):
    """Poisoned ``(pages, status)`` outputs; ``misalign`` 1 starts the rows off a 4-byte
    boundary (bit-shuffled pages then take the transposed decode, not the word tile)."""
    buf = torch.full((n * page_size + misalign,), POISON, dtype=torch.uint8)
    return buf[misalign:].view(n, page_size), torch.full((n,), -1, dtype=torch.int32)


MISALIGN = (0, 1)


@interpreter_only
def test_reported_int32_wrap_is_bad_size(bounds):  # noqa: F811
    """The reported reproducer: a 2**31 - 1 byte LZ4 page whose literal length extension runs
    on; the 32-bit positions of the fast loop wrapped and read at ``payload - 2**31``. Its size
    is past ``P - P/32``: ``STATUS_BAD_SIZE`` before any walk, and nothing read out of bounds."""
    n = 2**31 - 1
    pl = torch.zeros(n, dtype=torch.uint8)
    pl[:19] = torch.tensor([0xF0] + [0xFF] * 17 + [0], dtype=torch.uint8)
    sizes = bounds(torch.tensor([n], dtype=torch.int32))
    kinds = bounds(torch.tensor([fmt.KIND_LZ4], dtype=torch.uint8))
    offsets = bounds(torch.tensor([0], dtype=torch.int64))
    for misalign in MISALIGN:
        out, status = (bounds(t) for t in _outs(1, misalign=misalign))
        lz4_decompress.decompress_into(pl, offsets, sizes, kinds, out, status)
        assert status.tolist() == [fmt.STATUS_BAD_SIZE] and not out.any()
    assert cpu_codec.decompress_cpu(pl, offsets, sizes, kinds, P)[1].tolist() == [2]


@interpreter_only
def test_pages_past_2gib_of_payload_stay_in_bounds(bounds, gen):  # noqa: F811
    """Blocks at offsets past ``2**31`` (the base is int64), walks over a block of the
    largest LZ4 size with the reproducer's pattern at both ends of the payload (positions
    relative to the block stay small), RAW pages across the 2 GiB mark, a FILL at the last
    byte, and sizes one past the payload or the LZ4 limit (``LZ4_compressBound(P)``)."""
    limit = fmt.lz4_bound(P)
    total = 2**31 + 3 * P
    pl = torch.zeros(total, dtype=torch.uint8)
    walk = torch.tensor([0xF0] + [0xFF] * (limit - 2) + [0], dtype=torch.uint8)
    page = periodic_pages(int(torch.randint(1, 40, (1,), generator=gen)), 1, P, gen)
    block = torch.frombuffer(bytearray(lz4.block.compress(bytes(page[0].numpy()),
                                                          store_size=False)), dtype=torch.uint8)
    raw = torch.randint(0, 256, (P,), dtype=torch.uint8, generator=gen)
    hi = 2**31 + P - 5  # odd: unaligned loads; after the RAW page
    pl[:limit] = walk
    pl[total - limit:] = walk
    pl[hi:hi + block.numel()] = block
    pl[2**31 - 7:2**31 - 7 + P] = raw
    pl[-1] = 0x5C
    rows = [  # (offset, size, kind, status)
        (0, limit, fmt.KIND_LZ4, fmt.STATUS_TRUNCATED),
        (total - limit, limit, fmt.KIND_LZ4, fmt.STATUS_TRUNCATED),
        (total - limit, limit, fmt.KIND_LZ4 | 1 << 4, fmt.STATUS_TRUNCATED),
        (hi, block.numel(), fmt.KIND_LZ4, 0),
        (2**31 - 7, P, fmt.KIND_RAW, 0),
        (total - 1, 1, fmt.KIND_FILL, 0),
        (total - limit + 1, limit, fmt.KIND_LZ4, fmt.STATUS_BAD_SIZE),  # one past the end
        (hi, limit + 1, fmt.KIND_LZ4, fmt.STATUS_BAD_SIZE),  # past the LZ4 limit
        (total, 1, fmt.KIND_FILL, fmt.STATUS_BAD_SIZE),
        (2**62, limit, fmt.KIND_LZ4, fmt.STATUS_BAD_SIZE),
        (-(2**62), P, fmt.KIND_RAW, fmt.STATUS_BAD_SIZE),
    ]
    offsets = bounds(torch.tensor([r[0] for r in rows], dtype=torch.int64))
    sizes = bounds(torch.tensor([r[1] for r in rows], dtype=torch.int32))
    kinds = bounds(torch.tensor([r[2] for r in rows], dtype=torch.uint8))
    for misalign in MISALIGN:
        out, status = (bounds(t) for t in _outs(len(rows), misalign=misalign))
        lz4_decompress.decompress_into(pl, offsets, sizes, kinds, out, status)
        assert status.tolist() == [r[3] for r in rows], misalign
        assert torch.equal(out[3], page[0]) and torch.equal(out[4], raw)
        assert out[5].eq(0x5C).all() and not out[status != 0].any()


# ------------------------------------------------------------------ differential fuzz
def _rules(buf: bytes, off: int, size: int, kind: int, page_size: int):
    """``(page or None, status)`` by the format's rules, ``decode_block`` deciding blocks."""
    codec, shift = kind & 15, kind >> 4
    if codec > 2 or shift > 2 or (shift and codec != fmt.KIND_LZ4):
        return None, fmt.STATUS_BAD_KIND
    if off < 0 or size < 1 or off + size > len(buf):
        return None, fmt.STATUS_BAD_SIZE
    if codec == fmt.KIND_FILL:
        return (buf[off:off + 1] * page_size, 0) if size == 1 else (None, fmt.STATUS_BAD_SIZE)
    if codec == fmt.KIND_RAW:
        return (buf[off:off + size], 0) if size == page_size else (None, fmt.STATUS_BAD_SIZE)
    if size > fmt.lz4_bound(page_size):
        return None, fmt.STATUS_BAD_SIZE
    data, st = cpu_codec.decode_block(buf[off:off + size], page_size)
    if data is not None and shift:
        y = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(1, -1)
        data = bytes(bitunshuffle(y, 1 << shift)[0].numpy())
    return data, st


def _match_offsets(block: bytes) -> list[int]:
    """Positions of the match offset fields of a well-formed LZ4 block."""
    found, ip = [], 0
    while ip < len(block):
        tok = block[ip]
        ip += 1
        lit = tok >> 4
        if lit == 15:
            while True:
                lit += block[ip]
                ip += 1
                if block[ip - 1] != 255:
                    break
        ip += lit
        if ip >= len(block):
            break
        found.append(ip)
        ip += 2
        if tok & 15 == 15:
            while block[ip] == 255:
                ip += 1
            ip += 1
    return found


def _bases(page_size: int, element_size: int, gen: torch.Generator) -> torch.Tensor:
    """Pages that store as every kind: random (RAW), one byte (FILL), runs and periodic
    (LZ4, shuffled with ``element_size`` > 1)."""
    period = int(torch.randint(2, 24, (1,), generator=gen)) * element_size
    periodic = periodic_pages(period, 1, page_size, gen)
    # never one byte repeated: that page stores as FILL, and at 64 KiB (no run page below) the
    # batch would have no LZ4 page (period 1 did, in 1 of 23 runs)
    periodic[0, 1::period] = int(periodic[0, 0]) ^ 0x5A
    parts = [torch.randint(0, 256, (1, page_size), dtype=torch.uint8, generator=gen),
             torch.full((1, page_size), int(torch.randint(0, 256, (1,), generator=gen)),
                        dtype=torch.uint8),
             periodic]
    if page_size <= 4096:  # (64 KiB ones take the interpreter tens of seconds)
        parts.append(run_pages(1, page_size, gen))
        if element_size > 1:  # bf16 ReLU: many sequences unless shuffled
            vals = torch.randn(page_size // 2, generator=gen).relu().to(torch.bfloat16)
            parts.append(vals.view(torch.uint8).view(1, page_size))
    return torch.cat(parts)


MUTATIONS = ("none", "flip", "overwrite", "truncate", "extend", "size", "offset0", "kind",
             "offset")


def _mutate(rng: random.Random, block: bytes, off: int, kind: int, page_size: int, total: int):
    """``(block bytes, offset, size, kind, what)`` of one mutated page (the block's bytes are
    laid at ``off`` of the payload, followed by random bytes)."""
    b, size = bytearray(block), len(block)
    what = rng.choice(MUTATIONS)
    limit = fmt.lz4_bound(page_size)
    if what == "flip":
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif what == "overwrite":
        b[rng.randrange(len(b))] = rng.choice([0, 255, 15, 0xF0, 0xFF, rng.randrange(256)])
    elif what == "truncate" and size > 1:
        size = rng.randrange(1, size)
    elif what == "extend":
        size += rng.randrange(1, 48)
    elif what == "size":
        size = rng.choice([0, -1, -(2**31), 1, 2, fmt.lz4_keep_limit(page_size), limit,
                           limit + 1, page_size - 1, page_size, page_size + 1, 2**31 - 1,
                           rng.randrange(-(2**31), 2**31)])
    elif what == "offset0" and kind & 15 == fmt.KIND_LZ4 and _match_offsets(block):
        at = rng.choice(_match_offsets(block))
        b[at:at + 2] = b"\x00\x00"
    elif what == "kind":
        kind = rng.choice([0, 1, 2, 3, 15, 0x10, 0x11, 0x12, 0x21, 0x22, 0x31, 0xF1,
                           rng.randrange(256)])
    elif what == "offset":
        off = rng.choice([off + rng.randrange(-24, 24), -1, -(2**40), total - 1, total,
                          total - size + 1, 2**62, rng.randrange(-(2**63), 2**63)])
    else:
        what = "none"
    return bytes(b), off, size, kind, what


@interpreter_only
@pytest.mark.parametrize("page_size, element_size", [
    (4096, 1), (4096, 2), (4096, 4), (65536, 1),
    # 10-25 s each: the interpreter decodes a 64 KiB shuffled page transposed and unshuffles it
    pytest.param(65536, 2, marks=pytest.mark.slow), pytest.param(65536, 4, marks=pytest.mark.slow)])
def test_differential_fuzz_triton_vs_cpu(page_size, element_size, bounds, gen):  # noqa: F811
    """Mutated valid pages of every kind, in one packed payload: the Triton decoder (every
    access checked) gives the format's statuses and bytes, and so does ``decompress_cpu``."""
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    rng = random.Random(seed)
    pages = _bases(page_size, element_size, gen)
    payload, sizes, kinds = cpu_codec.compress_cpu(pages, element_size)
    kind_set = {int(k) for k in kinds}
    assert {k & 15 for k in kind_set} == {0, 1, 2}, kind_set
    blocks = [bytes(payload[i, : int(sizes[i])].numpy()) for i in range(len(sizes))]
    count = 24 if page_size == 4096 else 10
    pick = list(range(len(blocks))) + [rng.randrange(len(blocks)) for _ in
                                       range(count - len(blocks))]
    buf, meta, whats = bytearray(), [], []
    for j, i in enumerate(pick):  # every base once unmutated, then mutated random ones
        kind = int(kinds[i])
        blk, off, size, kind, what = _mutate(rng, blocks[i], len(buf), kind, page_size,
                                             len(buf) + len(blocks[i]))
        if j < len(blocks):
            blk, off, size, kind, what = blocks[i], len(buf), len(blocks[i]), int(kinds[i]), "none"
        if what == "offset0" and blk == blocks[i]:
            what = "none"
        buf += blk + rng.randbytes(rng.randrange(8, 64))  # real bytes after every block
        meta.append((off, size, kind))
        whats.append(what)
    meta.append((0, fmt.lz4_bound(page_size) + 1, 1))  # always one bad page (status 2)
    whats.append("overlong")
    buf = bytes(buf)
    flat = bounds(torch.frombuffer(bytearray(buf), dtype=torch.uint8))
    offsets = bounds(torch.tensor([m[0] for m in meta], dtype=torch.int64))
    sizes_t = bounds(torch.tensor([max(-(2**31), min(m[1], 2**31 - 1)) for m in meta],
                                  dtype=torch.int32))
    kinds_t = bounds(torch.tensor([m[2] for m in meta], dtype=torch.uint8))
    out, status = (bounds(t) for t in _outs(len(meta), page_size))
    lz4_decompress.decompress_into(flat, offsets, sizes_t, kinds_t, out, status)
    cpu_out, cpu_status = cpu_codec.decompress_cpu(flat, offsets, sizes_t, kinds_t, page_size)
    for j, (off, size, kind) in enumerate(meta):
        size = int(sizes_t[j])
        data, want = _rules(buf, off, size, kind, page_size)
        where = (f"seed {seed}, page {j} ({whats[j]}): offset {off} size {size} kind {kind:#x}")
        assert int(status[j]) == want, f"{where}: Triton status {int(status[j])} != {want}"
        got = bytes(out[j].numpy())
        assert got == (data if data is not None else bytes(page_size)), f"{where}: Triton bytes"
        cst = int(cpu_status[j])
        assert cst == want, f"{where}: CPU status {cst} != Triton {want}"
        assert bytes(cpu_out[j].numpy()) == got, f"{where}: CPU bytes differ"
    assert not status[: len(blocks)].any(), f"seed {seed}: an unmutated page failed"
    assert torch.equal(out[: len(blocks)], pages), f"seed {seed}"
    assert (status != 0).any()


def test_the_quick_container_check_accepts_only_what_the_full_check_accepts(gen):
    """``format.check_compressed`` decides the usual case in a few comparisons
    (``plainly_valid``, #26) and falls back to the item-by-item check: on valid containers
    and on one defect at a time (each field's dtype, shape, device, contiguity, type; the page
    size; the codec; a subclass), the quick check never passes one the full check refuses,
    and it passes the valid ones (else every call would pay the full check)."""
    from dataclasses import replace

    from torch_pagecomp import format as F

    n, p = int(torch.randint(1, 9, (1,), generator=gen)), 4096
    good_fixed = F.CompressedPages(torch.zeros(n, p, dtype=torch.uint8),
                                   torch.zeros(n, dtype=torch.int32),
                                   torch.zeros(n, dtype=torch.uint8), p)
    good_packed = F.CompressedPages(torch.zeros(n * 10, dtype=torch.uint8),
                                    torch.zeros(n, dtype=torch.int32),
                                    torch.zeros(n, dtype=torch.uint8), p,
                                    offsets=torch.zeros(n + 1, dtype=torch.int64),
                                    checksums=torch.zeros(n, dtype=torch.int32), codec="exp")

    class Sub(torch.Tensor):
        pass

    def variants(c):
        yield "valid", c
        for field in ("payload", "sizes", "kinds", "offsets", "checksums"):
            t = getattr(c, field)
            if t is None:
                yield f"{field} set", replace(c, **{field: torch.zeros(n, dtype=torch.int32)})
                continue
            yield f"{field} dtype", replace(c, **{field: t.to(torch.int16)})
            yield f"{field} shape", replace(c, **{field: torch.cat([t.flatten(), t.flatten()])})
            yield f"{field} 2-D", replace(c, **{field: t.reshape(1, -1)})
            yield f"{field} meta", replace(c, **{field: t.to("meta")})
            yield f"{field} subclass", replace(c, **{field: t.as_subclass(Sub)})
            yield f"{field} not a tensor", replace(c, **{field: t.tolist()})
            if t.numel() > 1:
                wide = torch.zeros(t.numel() * 2, dtype=t.dtype)[::2]
                yield f"{field} strided", replace(c, **{field: wide.reshape(t.shape)})
        for size in (4095, 2048, 3 * 4096, 1 << 17, True, 4096.0):
            yield f"page size {size!r}", replace(c, page_size=size)
        yield "codec", replace(c, codec="zstd")
        yield "not a container", (c.payload, c.sizes)

    for c in (good_fixed, good_packed):
        for what, v in variants(c):
            try:
                F._check_fully(v)
                full_ok = True
            except F.PageCompError:
                full_ok = False
            quick = F.plainly_valid(v)
            assert not quick or full_ok, f"{what}: the quick check passed what the full refuses"
            if what == "valid":
                assert quick, "the quick check refused a valid container"
            if not full_ok:  # and the public check still names the problem
                with pytest.raises(F.PageCompError):
                    F.check_compressed(v)
