"""Public Python API: ``compress``, ``decompress``, ``pack``, ``page_checksums``.

These validate inputs (errors name the problem), ask ``backend.route`` where the call runs and
call the ``torch.ops.pagecomp`` operators (eager calls on plain CUDA tensors launch the same
kernels directly, without the operator dispatch: ``backend.direct_launch_ok``). Only
``decompress`` (to raise on corrupt pages, unless asked for the statuses) and ``pack`` (to trim
to the exact size, unless ``exact=False``) synchronise.

Two codecs: ``"lz4"`` (the default: LZ4 blocks, bit-shuffled by ``element_size``) and the
exponent codec for pages of bf16 / fp16 values, ``codec="exp-bf16"`` / ``"exp-fp16"`` (EXP
pages: ``torch_pagecomp.format``). A container records which decoder reads it
(``CompressedPages.codec``: ``"lz4"`` or ``"exp"``) and :func:`decompress` follows it.
"""

from __future__ import annotations

import importlib
import sys

import torch

from . import _small
from . import format as fmt
from ._args import check_flag
from ._ops import (
    checksum_eager,
    compress_cpu_direct,
    compress_eager,
    compress_exp_eager,
    decompress_cpu_direct,
    decompress_eager,
    decompress_exp_eager,
    pack_eager,
)
from .backend import (  # noqa: F401
    BACKENDS,
    CPU,
    CPU_SERVED,
    INTERPRET,
    KERNELS,
    route,
)
from .format import CompressedPages, PageCompError

CODECS = ("lz4", "exp-bf16", "exp-fp16")  # what compress(codec=...) takes
DECODERS = ("lz4", "exp", "any")  # what decompress(codec=...) takes (None: the container's)


def _exp_format(codec: object, element_size: int | None) -> str | None:
    """``"bf16"`` / ``"fp16"`` for the exponent codecs, ``None`` for ``"lz4"``; raises
    ``PageCompError`` for an unknown codec or an element size the codec cannot take."""
    if codec not in CODECS:
        raise PageCompError(f"codec must be one of {CODECS}, got {codec!r}")
    if codec == "lz4":
        return None
    if element_size not in (None, 2):
        raise PageCompError(
            f"codec={codec!r} codes 2-byte floats: element_size must be 2 (or left out), "
            f"got {element_size!r}")
    return codec.removeprefix("exp-")


def compress(
    data: torch.Tensor,
    page_size: int | None = None,
    element_size: int | None = None,
    backend: str = "auto",
    checksum: bool = False,
    codec: str = "lz4",
    out: CompressedPages | None = None,
) -> CompressedPages:
    """Compress a batch of pages, each on its own.

    Args:
        data: ``uint8 [N, P]``, or 1-D ``uint8`` of ``N * page_size`` bytes; CPU or CUDA.
        page_size: ``P``, a power of two from 4096 to 65536 (default: ``data.shape[1]``, or 4096
            for 1-D input).
        element_size: 1 (bytes; the default), 2 (bf16/fp16) or 4 (fp32/int32): bit-shuffle
            each page by this element width before LZ4. The exponent codecs take 2 or nothing.
        backend: ``"auto"`` (see ``select_backend``), ``"cpu"`` (lz4) or ``"triton"``.
        checksum: also store each page's checksum (``checksums int32 [N]``, one more read of
            the pages): :func:`decompress` then flags a page that decodes to other bytes than
            were compressed (``STATUS_CHECKSUM``) instead of returning it.
        codec: ``"lz4"`` (default), or the exponent codec for pages that hold little-endian
            bf16 (``"exp-bf16"``) or fp16 (``"exp-fp16"``) values: each page's exponents
            coded against a table of 7, the most frequent among a quarter of its values
            (``torch_pagecomp.format``);
            1.42x on typical bf16 tensors where LZ4 stores 1.2-1.4x. Lossless for any bytes
            (the codec only stores worse when they are not such floats).
        out: a fixed-stride container of ``N`` pages of ``P`` bytes on ``data``'s device, of
            this codec (an earlier result, or one made by the caller), whose ``payload``,
            ``sizes`` and ``kinds`` (and ``checksums``, if it has them and ``checksum``) are
            overwritten: a caller that compresses batches of one shape again and again
            allocates nothing per call (the GPU kernel, or the CPU path's C loops, write them
            in place). None of its tensors may overlap ``data``.

    Returns:
        A fixed-stride :class:`CompressedPages` on ``data``'s device: ``payload uint8 [N, P]``,
        ``sizes int32 [N]``, ``kinds uint8 [N]`` (and ``checksums``); its ``codec`` is
        ``"lz4"`` or ``"exp"``. With ``out``, a container of ``out``'s tensors. No host
        synchronisation on the GPU path.
    """
    plan = _small.compress_plan(data, page_size, element_size, codec, backend, checksum, out)
    if plan is not None:  # a signature that passed every check below before (#26)
        if out is not None:
            _check_compress_out(out, plan.pages(data), plan.codec)
        return plan.run(data, out)
    pages = fmt.as_pages(data, page_size)
    check_flag("checksum", checksum)
    float_format = _exp_format(codec, element_size)
    lz4_es = 1 if element_size is None else element_size
    if float_format is None:
        # as an int: a numpy uint8(2) overflowed the kernels' sizes (64 * element_size)
        lz4_es = fmt.check_element_size(lz4_es)
        run = (torch.ops.pagecomp.compress, compress_eager, _COMPRESS_LZ4, lz4_es)
    else:
        run = (torch.ops.pagecomp.compress_exp, compress_exp_eager, _compress_exp_kernel,
               float_format)
    name = "lz4" if float_format is None else "exp"
    if out is not None:
        _check_compress_out(out, pages, name)
    where = route(backend, pages.shape[0], pages.device, (pages,))
    if where == CPU and pages.device.type == "cpu":  # checked: the reference path itself
        parts = compress_cpu_direct(pages, lz4_es, float_format,
                                    None if out is None else (out.payload, out.sizes, out.kinds))
    elif out is None:
        parts = _routed(where, pages.device, *run[:3], (pages,), run[3:])
    elif where in (KERNELS, INTERPRET):  # the kernel writes the caller's tensors
        parts = (out.payload, out.sizes, out.kinds)
        run[2](pages, *run[3:], traced=False, out=parts)
    else:
        parts = _routed(where, pages.device, *run[:3], (pages,), run[3:])
        parts = tuple(o.copy_(t) for o, t in zip((out.payload, out.sizes, out.kinds), parts))
    if not checksum:
        _small.learn_compress(data, page_size, element_size, codec, backend, out, pages,
                              lz4_es, float_format, where)
    sums = None
    if checksum:
        sums = page_checksums(pages, backend)
        if out is not None and out.checksums is not None:
            sums = out.checksums.copy_(sums)
    return CompressedPages(*parts, pages.shape[1], checksums=sums, codec=name)


def _check_compress_out(out: object, pages: torch.Tensor, codec: str) -> None:
    """Raise ``PageCompError`` unless ``out`` can take the compression of ``pages``
    (``uint8 [N, P]``) by ``codec`` (``"lz4"`` or ``"exp"``): see :func:`compress`. The
    usual case (it can) is a few comparisons; the message is built only when it cannot."""
    n, p = pages.shape
    dev = pages.device
    names = ("data", "payload", "sizes", "kinds", "checksums")
    if (type(out) is CompressedPages and out.offsets is None and out.page_size == p
            and out.codec == codec and _fits(out.payload, torch.uint8, (n, p), dev)
            and _fits(out.sizes, torch.int32, (n,), dev)
            and _fits(out.kinds, torch.uint8, (n,), dev)
            and (out.checksums is None or _fits(out.checksums, torch.int32, (n,), dev))
            and not _overlaps((pages,), (out.payload, out.sizes, out.kinds, out.checksums),
                              names)):
        return
    if not isinstance(out, CompressedPages):
        raise PageCompError(f"out must be CompressedPages, got {type(out).__name__}")
    fmt.check_compressed(out)
    problems = []
    if out.is_packed:
        problems.append("it is packed (out must be fixed-stride)")
    if (out.num_pages, out.page_size) != (n, p):
        problems.append(f"it holds {out.num_pages} pages of {out.page_size} bytes, the input "
                        f"{n} pages of {p}")
    if out.codec != codec:
        problems.append(f"its codec is {out.codec!r}, this call's {codec!r}")
    if out.device != dev:
        problems.append(f"it is on {out.device}, the input on {dev}")
    problems += _overlaps((pages,), (out.payload, out.sizes, out.kinds, out.checksums), names)
    if problems:
        raise PageCompError("compress: out cannot take this call: " + "; ".join(problems))


def _fits(t: object, dtype: torch.dtype, shape: tuple, device: torch.device) -> bool:
    """``t`` is a plain contiguous tensor of ``dtype`` and ``shape`` on ``device``."""
    return (type(t) is torch.Tensor and t.dtype == dtype and t.shape == shape
            and t.device == device and t.is_contiguous())


def _overlaps(inputs: tuple, outputs: tuple, names: tuple) -> list[str]:
    """``"a and b overlap"`` for each pair of tensors whose bytes overlap, one of ``outputs``
    and the other an input or an earlier output (``None`` entries skipped; ``names``: the
    inputs' then the outputs'). None under ``torch.compile``, whose tensors have no addresses
    (its copy into the outputs is functional there)."""
    tensors = inputs + outputs
    return [f"{names[a]} and {names[b]} overlap"  # each output against everything before it
            for b in range(len(inputs), len(tensors)) if tensors[b] is not None
            for a in range(b) if _overlapping(tensors[b], (tensors[a],))]


def _overlapping(t: torch.Tensor, others: tuple) -> bool:
    """Whether ``t``'s bytes overlap those of any of ``others`` (``None`` skipped; False
    under ``torch.compile``, whose tensors have no addresses): an ``out=`` check's usual
    case, answered without :func:`_overlaps`' messages."""
    if torch.compiler.is_compiling() or not t.nbytes:
        return False
    lo = t.data_ptr()
    hi = lo + t.nbytes
    for o in others:
        if o is not None and o.nbytes:
            start = o.data_ptr()
            if start < hi and lo < start + o.nbytes:
                return True
    return False


def _routed(where: str, device: torch.device, op, eager, kernel, tensors: tuple,
            consts: tuple = ()):
    """``op`` (a ``torch.ops.pagecomp`` operator) of ``tensors`` then ``consts``, run where
    ``route`` sent the call, its outputs on ``device``: ``CPU`` ``eager`` on host copies
    (the op's reference path; without the dispatch where the call is eager);
    ``KERNELS`` ``kernel`` launching directly (the public functions checked the arguments
    already, so the eager entry's second check is skipped); otherwise on a CUDA device (``OP``, or
    ``CPU_SERVED``: the op serves it on the host) the op; ``INTERPRET`` ``kernel``, the Triton
    launcher; ``UPLOAD`` the op on GPU copies of host tensors, brought back."""
    if where == CPU:
        return _to(eager(*(t.cpu() for t in tensors), *consts), device)
    if where == KERNELS:  # checked by the caller (as_pages, check_compressed): the launcher
        return kernel(*tensors, *consts, traced=False)  # (the eager entry checks again)
    if device.type == "cuda":
        return op(*tensors, *consts)
    if where == INTERPRET:
        return kernel(*tensors, *consts)
    gpu = [t.to("cuda", non_blocking=t.is_pinned()) for t in tensors]
    return _to(op(*gpu, *consts), device)


def _to(out, device: torch.device):
    """An op's output (a tensor or a tuple of them) on ``device``."""
    if isinstance(out, torch.Tensor):
        return out.to(device)
    return tuple(t.to(device) for t in out)


def _launcher(module: str, name: str):
    """``torch_pagecomp.kernels.<module>.<name>``, imported when first called (Triton loads
    on use) and looked up at each call. Made once per launcher (below), not per call: an
    import through ``importlib`` costs a small call microseconds of host time (#26)."""
    full = f"{__package__}.kernels.{module}"

    def call(*args, **kwargs):
        kernels = sys.modules.get(full) or importlib.import_module(full)
        return getattr(kernels, name)(*args, **kwargs)

    return call


_COMPRESS_LZ4 = _launcher("lz4_compress", "compress_pages")
_CHECKSUMS = _launcher("checksum", "page_checksums")
_DECOMPRESS_LZ4 = _launcher("lz4_decompress", "decompress_pages")
_DECOMPRESS_EXP = _launcher("exp_codec", "decompress_exp_pages")
_INTO_LZ4 = _launcher("lz4_decompress", "decompress_into")
_INTO_EXP = _launcher("exp_codec", "decompress_exp_into")


def _compress_exp_kernel(pages: torch.Tensor, float_format: str, traced: bool = True,
                         out: tuple | None = None):
    """The exponent encoder's launcher with the op's arguments."""
    from .kernels.exp_codec import compress_exp_pages

    return compress_exp_pages(pages, float_format == "fp16", traced=traced, out=out)


def page_checksums(data: torch.Tensor, backend: str = "auto",
                   page_size: int | None = None) -> torch.Tensor:
    """The format's checksum of each page (``torch_pagecomp.format``): its xxHash32, seed 0,
    as ``int32`` (``& 0xFFFFFFFF`` gives what any xxHash library returns for the page).

    Args:
        data: ``uint8 [N, P]``, or 1-D ``uint8`` of ``N * page_size`` bytes; CPU or CUDA.
        backend, page_size: as for :func:`compress`.
    Returns:
        ``int32 [N]`` on ``data``'s device; no host synchronisation.
    """
    pages = fmt.as_pages(data, page_size)
    where = route(backend, pages.shape[0], pages.device, (pages,))
    return _routed(where, pages.device, torch.ops.pagecomp.checksum, checksum_eager,
                   _CHECKSUMS, (pages,))


def decompress(
    c: CompressedPages,
    return_status: bool = False,
    backend: str = "auto",
    codec: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decompress every page of ``c`` (fixed-stride or packed) bit-exactly.

    ``codec`` picks the decoder: ``None`` (default) the one ``c.codec`` names; ``"lz4"``
    (RAW, FILL, LZ4 pages), ``"exp"`` (RAW, FILL, EXP pages); each gives the other's pages
    ``STATUS_BAD_KIND``. ``"any"`` runs both and takes each page from the decoder of its kind
    (twice the decoding work: for containers that mix the codecs' pages).

    Returns:
        ``pages uint8 [N, P]`` on ``c``'s device. Corrupt pages raise :class:`CorruptPageError`
        naming them (this reads the statuses: a synchronisation). With ``return_status=True``
        returns ``(pages, status int32 [N])`` instead and never synchronises; failed pages have a
        non-zero status (``format.STATUS_*``) and zero bytes; every other page is correct.

    With ``c.checksums`` (``compress(..., checksum=True)``) each decoded page's checksum is
    compared on the device (one more read of the pages): a page that decoded without error to
    other bytes than were compressed fails with ``STATUS_CHECKSUM``.

    A packed container's page ``i`` whose offsets disagree with its size
    (``offsets[i + 1] - offsets[i] != sizes[i]``, or ``offsets[0] != 0`` for page 0) fails with
    ``STATUS_BAD_SIZE`` (worked out on the device, no synchronisation); the error names it.

    ``out``: ``uint8 [N, P]`` (contiguous, on ``c``'s device, overlapping none of ``c``'s
    tensors) to decode into and return, instead of a new tensor: a caller that restores
    batches of one shape again and again allocates no pages per call (the GPU's decoder, or
    the CPU path's C loops, write them in place).
    """
    decoder = _small.direct_decoder(c, codec, backend)
    if decoder is not None:  # a plain fixed-stride container on the GPU (#26)
        if out is not None:
            _check_decompress_out(out, c)
        pages, status = _small.decode(decoder, c, out)
        if return_status:
            return pages, status
        raise_for_status(status)
        return pages
    if not isinstance(c, CompressedPages):
        raise PageCompError(f"decompress takes CompressedPages, got {type(c).__name__}")
    fmt.check_compressed(c)
    codec = c.codec if codec is None else codec
    if codec not in DECODERS:
        raise PageCompError(f"decompress: codec must be None or one of {DECODERS}, got {codec!r}")
    if out is not None:
        _check_decompress_out(out, c)
    mismatch = offsets_mismatch(c)
    sizes = c.sizes if mismatch is None else torch.where(mismatch, 0, c.sizes)  # 0: BAD_SIZE
    payload = c.payload.view(-1)
    inputs = (payload, sizes, c.kinds) + ((c.offsets,) if c.offsets is not None else ())
    where = route(backend, c.num_pages, c.device, inputs)
    host = where == CPU and c.device.type == "cpu"
    if where in (KERNELS, INTERPRET) or host:  # the decoders' launchers or the host codec,
        # into ``out`` or new pages; a fixed-stride container passes no offsets (page i at
        # i * P: none built per call)
        args = (payload, c.offsets[:-1] if c.offsets is not None else None, sizes, c.kinds)
        decode = _decode if host else _decode_direct
    else:
        args, decode = (payload, c.page_offsets(), sizes, c.kinds), _decode
    if codec != "any":
        pages, status = decode(codec, c, where, args, out)
    else:  # each page from the decoder of its kind (the other one gave it BAD_KIND)
        lz4_pages, lz4_status = decode("lz4", c, where, args)
        exp_pages, exp_status = decode("exp", c, where, args)
        exp = ((c.kinds & 15) == fmt.KIND_EXP).to(lz4_status.device)
        pages = torch.where(exp[:, None], exp_pages, lz4_pages)
        status = torch.where(exp, exp_status, lz4_status)
    if out is not None and pages is not out:  # "any": picked from the two decoders' pages
        pages = out.copy_(pages)
    if c.checksums is not None:  # decoded, but to the bytes that were compressed?
        status = checksum_status(status, page_checksums(pages, backend), c.checksums)
        # a page that decoded to other bytes is zeroed, as the decoders zero the pages they
        # fail: no caller reads bytes known to be wrong (on the device, no synchronisation)
        pages.masked_fill_((status == fmt.STATUS_CHECKSUM).view(-1, 1), 0)
    if return_status:
        return pages, status
    raise_for_status(status, mismatch)
    return pages


def _check_decompress_out(out: object, c: CompressedPages) -> None:
    """Raise ``PageCompError`` unless ``out`` can take ``c``'s pages: see :func:`decompress`
    (a few comparisons when it can; the message is built only when it cannot)."""
    want = (c.num_pages, c.page_size)
    named = (c.payload, c.sizes, c.kinds, c.offsets, c.checksums)
    if _fits(out, torch.uint8, want, c.payload.device) and not _overlapping(out, named):
        return
    names = ("payload", "sizes", "kinds", "offsets", "checksums", "out")
    if not isinstance(out, torch.Tensor):
        raise PageCompError(f"decompress: out must be a torch.Tensor, got {type(out).__name__}")
    problems = []
    if out.dtype != torch.uint8 or tuple(out.shape) != want:
        problems.append(f"it must be uint8 {list(want)}, got {out.dtype} {list(out.shape)}")
    if out.device != c.device:
        problems.append(f"it is on {out.device}, the pages on {c.device}")
    if not out.is_contiguous():
        problems.append(f"it must be contiguous, got strides {list(out.stride())}")
    problems += _overlaps(named, (out,), names)
    if problems:
        raise PageCompError("decompress: out cannot take the pages: " + "; ".join(problems))


def _decode(decoder: str, c: CompressedPages, where: str, args: tuple, out=None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages, status)`` of ``args`` (``pagecomp::decompress``'s, less the page size) by
    ``decoder`` (``"lz4"``: ``pagecomp::decompress``; ``"exp"``: ``pagecomp::decompress_exp``)
    where ``route`` sent the call, into ``out`` when given (in place on the host, copied
    there elsewhere)."""
    if where == CPU and c.device.type == "cpu":  # checked: the reference path itself
        return decompress_cpu_direct(*args, c.page_size, decoder == "exp", out)
    if decoder == "lz4":
        run = (torch.ops.pagecomp.decompress, decompress_eager,
               _DECOMPRESS_LZ4)
    else:
        run = (torch.ops.pagecomp.decompress_exp, decompress_exp_eager,
               _DECOMPRESS_EXP)
    pages, status = _routed(where, c.device, *run, args, (c.page_size,))
    return (pages if out is None else out.copy_(pages)), status


def _decode_direct(decoder: str, c: CompressedPages, where: str, args: tuple, out=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_decode` by the decoder's launcher itself (routes ``KERNELS`` and
    ``INTERPRET``), into ``out`` when given; ``args``' offsets may be None (fixed stride)."""
    pages = out if out is not None else torch.empty(
        (c.num_pages, c.page_size), dtype=torch.uint8, device=c.device)
    status = torch.empty((c.num_pages,), dtype=torch.int32, device=c.device)
    into = _INTO_LZ4 if decoder == "lz4" else _INTO_EXP
    into(*args, pages, status, traced=False)
    return pages, status


def checksum_status(status: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``status`` with ``STATUS_CHECKSUM`` where a page decoded without error (status OK) to
    bytes whose checksum ``got`` is not the stored ``want`` (all ``int32 [N]``; device work,
    no synchronisation where ``got`` is on a GPU; a GPU's ``want`` checked on the CPU is copied
    down and waited for: a non-blocking copy to the host lands behind the GPU's queued work,
    and the host would compare it before it landed)."""
    wrong = got != want.to(got.device, non_blocking=got.is_cuda)
    return torch.where((status == fmt.STATUS_OK) & wrong, fmt.STATUS_CHECKSUM, status)


OFFSETS_MISMATCH = "bad size (offsets[i + 1] - offsets[i] != sizes[i] in the packed container)"


def offsets_mismatch(c: CompressedPages) -> torch.Tensor | None:
    """``bool [N]`` on ``c``'s device: pages of a packed container whose offsets disagree with
    their sizes (``offsets[i + 1] - offsets[i] != sizes[i]``; page 0 also when
    ``offsets[0] != 0``); ``None`` for a fixed-stride container. Device work on ``N`` numbers,
    no synchronisation. (Whether each page lies inside the payload the decoders check.)"""
    if c.offsets is None:
        return None
    o = c.offsets
    bad = (o[1:] - o[:-1]) != c.sizes
    bad[:1] |= o[:1] != 0
    return bad


def raise_for_status(status: torch.Tensor, mismatch: torch.Tensor | None = None) -> None:
    """Raise :class:`CorruptPageError` naming every page whose status is not OK (synchronises).
    ``mismatch`` (from :func:`offsets_mismatch`) marks pages failed for their offsets."""
    if not isinstance(status, torch.Tensor) or status.dim() != 1:
        raise PageCompError(f"status must be a 1-D tensor (one per page), got {fmt._desc(status)}")
    if status.is_floating_point() or status.is_complex():
        raise PageCompError(f"status must be an integer tensor (format.STATUS_* codes), got "
                            f"{fmt._desc(status)}")
    if mismatch is not None and (not isinstance(mismatch, torch.Tensor)
                                 or tuple(mismatch.shape) != tuple(status.shape)):
        raise PageCompError(f"mismatch must be a tensor shaped as status {tuple(status.shape)}, "
                            f"got {fmt._desc(mismatch)}")
    for name, t in (("status", status), ("mismatch", mismatch)):
        if t is not None and t.is_meta:
            raise PageCompError(f"{name} is on the meta device: a meta tensor holds no values")
    # the usual case, no failed page: one reduction, where nonzero builds an index
    cpu = type(status) is torch.Tensor and status.device.type == "cpu"
    if not (status.numpy().any() if cpu else status.any()):
        return
    bad = torch.nonzero(status).flatten().tolist()
    if bad:
        codes = status[bad].tolist()
        reasons = [fmt.STATUS_NAMES.get(s, f"status {s}") for s in codes]
        if mismatch is not None:
            flags = mismatch.to(status.device)[bad].tolist()
            reasons = [OFFSETS_MISMATCH if f else r for f, r in zip(flags, reasons)]
        raise fmt.CorruptPageError(bad, reasons)


def pack(c: CompressedPages, exact: bool = True) -> CompressedPages:
    """Fixed-stride -> packed form (payloads back to back, ``offsets int64 [N + 1]``).

    With ``exact=True`` the payload is trimmed to ``sum(sizes)`` bytes (reads one number: a
    synchronisation on the GPU). With ``exact=False`` it keeps the upper bound ``N * P`` bytes and
    never synchronises. A packed input is returned as it is.
    """
    fmt.check_compressed(c)
    if c.is_packed:
        return c
    host = route("auto", None, c.device) in (CPU, CPU_SERVED)  # the reference path
    packed, offsets = (pack_eager if host else torch.ops.pagecomp.pack)(c.payload, c.sizes)
    if exact:
        packed = packed[: int(offsets[-1])].clone()
    return CompressedPages(packed, c.sizes, c.kinds, c.page_size, offsets, c.checksums,
                           c.codec)
