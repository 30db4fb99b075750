"""The one registry of ``torch.ops.pagecomp`` operators.

Public ops (``N`` pages of ``P`` bytes), registered with ``torch.library.triton_op`` so that
``torch.compile`` traces into the Triton kernels and CUDA graphs capture them; none of them
synchronises with the host:

* ``pagecomp::compress(Tensor pages, int element_size=1) -> (Tensor payload, Tensor sizes,
  Tensor kinds)``: ``pages`` ``uint8 [N, P]`` -> fixed-stride ``payload`` ``uint8 [N, P]``,
  ``sizes`` ``int32 [N]``, ``kinds`` ``uint8 [N]``.
* ``pagecomp::decompress(Tensor payload, Tensor offsets, Tensor sizes, Tensor kinds, int page_size)
  -> (Tensor pages, Tensor status)``: ``payload`` ``uint8 [T]``, ``offsets`` ``int64 [N]`` (start of
  each page) -> ``pages`` ``uint8 [N, P]``, ``status`` ``int32 [N]`` (0 = ok, see ``format``).
* ``pagecomp::pack(Tensor payload, Tensor sizes) -> (Tensor packed, Tensor offsets)``: fixed-stride
  ``[N, P]`` -> ``packed`` ``uint8 [N * P]`` (first ``offsets[N]`` bytes meaningful) and ``offsets``
  ``int64 [N + 1]``.
* ``pagecomp::checksum(Tensor pages) -> Tensor``: ``pages`` ``uint8 [N, P]`` -> the format's page
  checksums, ``int32 [N]``.
* ``pagecomp::compress_exp(Tensor pages, str float_format) -> (Tensor payload, Tensor sizes,
  Tensor kinds)``: the exponent codec (``float_format`` ``"bf16"`` or ``"fp16"``: what the pages
  hold) -> fixed-stride outputs as ``compress``'s, with EXP pages instead of LZ4 ones.
* ``pagecomp::decompress_exp(Tensor payload, Tensor offsets, Tensor sizes, Tensor kinds,
  int page_size) -> (Tensor pages, Tensor status)``: as ``decompress``, for RAW, FILL and EXP
  pages (an LZ4 page is ``STATUS_BAD_KIND``, as an EXP page is to ``decompress``).

Each dispatches to the Triton launchers for CUDA tensors when the GPU path is usable, and
otherwise to an opaque reference op (``pagecomp::*_reference``) built on the ``lz4`` package:
on the CPU directly, for CUDA tensors "CPU-served" (copied to the host and back).

Every op, reference op and eager entry point first validates its arguments with
``torch_pagecomp.format.check_*_args`` (shapes, dtypes, strides, devices, page size: nothing that
reads a tensor's values, so no synchronisation and traceable), raising ``PageCompError``. What
the values say (sizes, offsets, kinds, blocks) the decoders check page by page: a status each.
"""

from __future__ import annotations

import importlib.util

import torch
from torch.library import custom_op, triton_op

from . import cpu_codec, exp_codec
from . import format as fmt
from .backend import KERNELS, eager_call_ok, route

Tensor = torch.Tensor

# Without Triton the public ops are plain custom ops over the reference path (``triton_op``
# would scan each op for kernels and log "Triton not available" once per op).
def _have_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _triton_op(name: str, **kwargs):
    """``torch.library.triton_op`` without its scan of the op's source for Triton kernels.

    Where torch has it (2.13), ``triton_op`` parses each op's source for the kernels it launches
    (best effort, for the AOTAutograd cache's keys), importing ``torch._inductor.utils`` and with
    it Dynamo to do so: ~2.7 s of every ``import torch_pagecomp`` on a 2-core VM, of 6.7. Our ops
    reach their kernels through launchers imported inside the function bodies, which the scan
    does not follow: it found no kernel in any of them. So the scan is replaced, while our ops
    register, by its result; everything else ``triton_op`` does is kept."""
    register = triton_op(name, **kwargs)

    def decorate(fn):
        try:
            import torch._library.triton as library
        except ImportError:  # a torch that lays triton_op out otherwise: no scan to skip
            library = None
        scan = getattr(library, "get_inner_triton_kernels", None)
        if scan is None:
            return register(fn)
        library.get_inner_triton_kernels = lambda fn: []
        try:
            return register(fn)
        finally:
            library.get_inner_triton_kernels = scan

    return decorate


_op = _triton_op if _have_triton() else custom_op


def _use_triton(t: Tensor) -> bool:
    """Whether an op on ``t`` (left where it is) runs the Triton kernels: ``backend.route``'s
    decision, the same one the public API takes."""
    return route("auto", None, t.device) == KERNELS


# ------------------------------------------------------------------- reference (lz4) ops
def _reference(ref, op, *args):
    """``op`` (a public op) of ``args`` on its reference path: ``ref`` (its code, arguments
    already checked) called directly where :func:`backend.eager_call_ok` allows, which spares
    two layers of operator dispatch (~150 us of host time per call on a 2-core VM, several
    times the lz4 work of a 16-page batch); otherwise the op, so that ``torch.compile`` and
    dispatch modes see it. Meta tensors (checked: all on one device) go through the op too,
    whose fake implementation gives meta outputs of its shapes: ``ref`` would read their
    values, which they do not hold."""
    tensors = tuple(a for a in args if isinstance(a, Tensor))
    return ref(*args) if eager_call_ok(tensors) and not tensors[0].is_meta else op(*args)


# The reference paths (lz4 and numpy / C on the host), arguments already checked: each
# ``*_reference`` op runs one, and so does each eager entry point through :func:`_reference`.
def _compress_ref(pages: Tensor, element_size: int) -> tuple[Tensor, Tensor, Tensor]:
    out = cpu_codec.compress_cpu(pages.cpu(), element_size)
    return tuple(t.to(pages.device) for t in out)


def _decompress_ref(payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor,
                    page_size: int, exp: bool = False) -> tuple[Tensor, Tensor]:
    """``exp``: the exponent codec's decoder, else LZ4's."""
    decode = exp_codec.decompress_exp_cpu if exp else cpu_codec.decompress_cpu
    pages, status = decode(payload.cpu(), offsets.cpu(), sizes.cpu(), kinds.cpu(), page_size)
    return pages.to(payload.device), status.to(payload.device)


def _decompress_exp_ref(payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor,
                        page_size: int) -> tuple[Tensor, Tensor]:
    return _decompress_ref(payload, offsets, sizes, kinds, page_size, exp=True)


def compress_cpu_direct(pages: Tensor, element_size: int, float_format: str | None,
                        out: tuple[Tensor, Tensor, Tensor] | None = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """The reference compressor of CPU ``pages`` (``uint8 [N, P]``, arguments checked by the
    caller) by ``float_format``'s exponent codec, else LZ4 at ``element_size``: called directly
    where :func:`backend.eager_call_ok` allows (no second check, no dispatch), otherwise
    through the op. Returns fixed-stride ``(payload uint8 [N, P], sizes int32 [N], kinds uint8
    [N])``: ``out``'s tensors (contiguous CPU ones, written in place by the C loops) when
    given."""
    if not eager_call_ok((pages, *(out or ()))):
        got = compress_codec_eager(pages, element_size, float_format)
        return got if out is None else tuple(o.copy_(t) for o, t in zip(out, got))
    if float_format is not None:
        return exp_codec.compress_exp_cpu(pages, exp_codec.layout_code(float_format), out=out)
    return cpu_codec.compress_cpu(pages, element_size, out=out)


def decompress_cpu_direct(payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor,
                          page_size: int, exp: bool, out: Tensor | None = None
                          ) -> tuple[Tensor, Tensor]:
    """The reference decoder (``exp``: the exponent codec's, else LZ4's) of CPU tensors
    (arguments checked by the caller, as ``pagecomp::decompress``'s; ``offsets`` None: a
    fixed-stride payload): called directly where :func:`backend.eager_call_ok` allows,
    otherwise through the op. Returns ``(pages uint8 [N, P], status int32 [N])``, ``pages``
    being ``out`` (contiguous, CPU, overlapping no input; written in place by the C loops)
    when given."""
    if not eager_call_ok((payload, sizes, kinds) + tuple(t for t in (offsets, out)
                                                         if t is not None)):
        if offsets is None:
            offsets = cpu_codec.stride_offsets(sizes.shape[0], page_size)
        decode = decompress_exp_eager if exp else decompress_eager
        pages, status = decode(payload, offsets, sizes, kinds, page_size)
        return (pages if out is None else out.copy_(pages)), status
    decode = exp_codec.decompress_exp_cpu if exp else cpu_codec.decompress_cpu
    return decode(payload, offsets, sizes, kinds, page_size, out=out)


def _pack_ref(payload: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    packed, offsets = cpu_codec.pack_cpu(payload.cpu(), sizes.cpu())
    return packed.to(payload.device), offsets.to(payload.device)


def _checksum_ref(pages: Tensor) -> Tensor:
    return cpu_codec.page_checksums_cpu(pages.cpu()).to(pages.device)


def _compress_exp_ref(pages: Tensor, float_format: str) -> tuple[Tensor, Tensor, Tensor]:
    out = exp_codec.compress_exp_cpu(pages.cpu(), exp_codec.layout_code(float_format))
    return tuple(t.to(pages.device) for t in out)


@custom_op("pagecomp::compress_reference", mutates_args=())
def compress_reference(pages: Tensor, element_size: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    fmt.check_compress_args(pages, element_size)
    return _compress_ref(pages, element_size)


def _compressed_like(pages: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A compress op's outputs' shapes (fake tensors): ``(payload [N, P], sizes int32 [N],
    kinds uint8 [N])``."""
    n, p = pages.shape
    return (
        pages.new_empty((n, p)),
        pages.new_empty((n,), dtype=torch.int32),
        pages.new_empty((n,), dtype=torch.uint8),
    )


def _decompressed_like(payload: Tensor, sizes: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """A decompress op's outputs' shapes (fake tensors): ``(pages [N, P], status int32 [N])``."""
    n = sizes.shape[0]
    return payload.new_empty((n, page_size)), payload.new_empty((n,), dtype=torch.int32)


@compress_reference.register_fake
def _(pages, element_size=1):
    fmt.check_compress_args(pages, element_size)
    return _compressed_like(pages)


@custom_op("pagecomp::decompress_reference", mutates_args=())
def decompress_reference(
    payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor, page_size: int
) -> tuple[Tensor, Tensor]:
    fmt.check_decompress_args(payload, offsets, sizes, kinds, page_size)
    return _decompress_ref(payload, offsets, sizes, kinds, page_size)


@decompress_reference.register_fake
def _(payload, offsets, sizes, kinds, page_size):
    fmt.check_decompress_args(payload, offsets, sizes, kinds, page_size)
    return _decompressed_like(payload, sizes, page_size)


@custom_op("pagecomp::pack_reference", mutates_args=())
def pack_reference(payload: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    fmt.check_pack_args(payload, sizes)
    return _pack_ref(payload, sizes)


@pack_reference.register_fake
def _(payload, sizes):
    fmt.check_pack_args(payload, sizes)
    n, p = payload.shape
    return payload.new_empty((n * p,)), payload.new_empty((n + 1,), dtype=torch.int64)


@custom_op("pagecomp::checksum_reference", mutates_args=())
def checksum_reference(pages: Tensor) -> Tensor:
    fmt.check_checksum_args(pages)
    return _checksum_ref(pages)


@checksum_reference.register_fake
def _(pages):
    fmt.check_checksum_args(pages)
    return pages.new_empty((pages.shape[0],), dtype=torch.int32)


@custom_op("pagecomp::compress_exp_reference", mutates_args=())
def compress_exp_reference(pages: Tensor, float_format: str) -> tuple[Tensor, Tensor, Tensor]:
    fmt.check_compress_exp_args(pages, float_format)
    return _compress_exp_ref(pages, float_format)


@compress_exp_reference.register_fake
def _(pages, float_format):
    fmt.check_compress_exp_args(pages, float_format)
    return _compressed_like(pages)


@custom_op("pagecomp::decompress_exp_reference", mutates_args=())
def decompress_exp_reference(
    payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor, page_size: int
) -> tuple[Tensor, Tensor]:
    fmt.check_decompress_args(payload, offsets, sizes, kinds, page_size, op="decompress_exp")
    return _decompress_exp_ref(payload, offsets, sizes, kinds, page_size)


@decompress_exp_reference.register_fake
def _(payload, offsets, sizes, kinds, page_size):
    fmt.check_decompress_args(payload, offsets, sizes, kinds, page_size, op="decompress_exp")
    return _decompressed_like(payload, sizes, page_size)


# ------------------------------------------------------------------------ public ops
@_op("pagecomp::compress", mutates_args=())
def compress(pages: Tensor, element_size: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    fmt.check_compress_args(pages, element_size)
    if not _use_triton(pages):
        return compress_reference(pages, element_size)
    from .kernels.lz4_compress import compress_pages

    return compress_pages(pages, element_size)


@_op("pagecomp::decompress", mutates_args=())
def decompress(
    payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor, page_size: int
) -> tuple[Tensor, Tensor]:
    fmt.check_decompress_args(payload, offsets, sizes, kinds, page_size)
    if not _use_triton(payload):
        return decompress_reference(payload, offsets, sizes, kinds, page_size)
    from .kernels.lz4_decompress import decompress_pages

    return decompress_pages(payload, offsets, sizes, kinds, page_size)


@_op("pagecomp::pack", mutates_args=())
def pack(payload: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    fmt.check_pack_args(payload, sizes)
    if not _use_triton(payload):
        return pack_reference(payload, sizes)
    from .kernels.pack import pack_pages

    return pack_pages(payload, sizes)


@_op("pagecomp::checksum", mutates_args=())
def checksum(pages: Tensor) -> Tensor:
    fmt.check_checksum_args(pages)
    if not _use_triton(pages):
        return checksum_reference(pages)
    from .kernels.checksum import page_checksums

    return page_checksums(pages)


@_op("pagecomp::compress_exp", mutates_args=())
def compress_exp(pages: Tensor, float_format: str) -> tuple[Tensor, Tensor, Tensor]:
    fmt.check_compress_exp_args(pages, float_format)
    if not _use_triton(pages):
        return compress_exp_reference(pages, float_format)
    from .kernels.exp_codec import compress_exp_pages

    return compress_exp_pages(pages, float_format == "fp16")


@_op("pagecomp::decompress_exp", mutates_args=())
def decompress_exp(
    payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor, page_size: int
) -> tuple[Tensor, Tensor]:
    fmt.check_decompress_args(payload, offsets, sizes, kinds, page_size, op="decompress_exp")
    if not _use_triton(payload):
        return decompress_exp_reference(payload, offsets, sizes, kinds, page_size)
    from .kernels.exp_codec import decompress_exp_pages

    return decompress_exp_pages(payload, offsets, sizes, kinds, page_size)


# ------------------------------------------------------------------- eager entry points
# For eager callers that enqueue on their own streams (the pipeline): the same kernels and
# results as the ops above, without the operator dispatch and with the kernel launched directly
# (the dispatch is a large share of an op call's host time, which bounds how fast small batches
# can be issued). Not traceable: never call from a model.
def compress_eager(pages: Tensor, element_size: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """As ``torch.ops.pagecomp.compress``."""
    fmt.check_compress_args(pages, element_size)
    if not _use_triton(pages):
        return _reference(_compress_ref, torch.ops.pagecomp.compress, pages, element_size)
    from .kernels.lz4_compress import compress_pages

    return compress_pages(pages, element_size, traced=False)


def decompress_eager(
    payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor, page_size: int
) -> tuple[Tensor, Tensor]:
    """As ``torch.ops.pagecomp.decompress``."""
    fmt.check_decompress_args(payload, offsets, sizes, kinds, page_size)
    if not _use_triton(payload):
        return _reference(_decompress_ref, torch.ops.pagecomp.decompress, payload, offsets,
                          sizes, kinds, page_size)
    from .kernels.lz4_decompress import decompress_pages

    return decompress_pages(payload, offsets, sizes, kinds, page_size, traced=False)


def pack_eager(payload: Tensor, sizes: Tensor, zero_tail: bool = True) -> tuple[Tensor, Tensor]:
    """As ``torch.ops.pagecomp.pack``; ``zero_tail=False``: bytes past ``offsets[N]`` are
    left unwritten on the GPU (see ``torch_pagecomp.kernels.pack.pack_pages``)."""
    fmt.check_pack_args(payload, sizes)
    if not _use_triton(payload):
        return _reference(_pack_ref, torch.ops.pagecomp.pack, payload, sizes)
    from .kernels.pack import pack_pages

    return pack_pages(payload, sizes, traced=False, zero_tail=zero_tail)


def checksum_eager(pages: Tensor) -> Tensor:
    """As ``torch.ops.pagecomp.checksum``."""
    fmt.check_checksum_args(pages)
    if not _use_triton(pages):
        return _reference(_checksum_ref, torch.ops.pagecomp.checksum, pages)
    from .kernels.checksum import page_checksums

    return page_checksums(pages, traced=False)


def publish_total_eager(src: Tensor, dst: Tensor) -> None:
    """``dst`` (pinned host ``int64 [1]``) = ``src`` (``int64 [1]`` on the GPU) by a kernel store
    on the current stream (see ``torch_pagecomp.kernels.pack.publish_to_host``)."""
    from .kernels.pack import publish_to_host

    publish_to_host(src, dst, traced=False)


def decompress_into_eager(
    payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor, pages: Tensor, status: Tensor,
    exp: bool = False,
) -> None:
    """As ``torch.ops.pagecomp.decompress`` (``exp``: ``decompress_exp``, the exponent codec's
    decoder), written into ``pages`` ``uint8 [N, P]`` (contiguous) and ``status`` ``int32
    [N]`` on the current stream."""
    op = "decompress_exp" if exp else "decompress"
    if not isinstance(pages, Tensor) or pages.dim() != 2:
        desc = f"{pages.dtype} {list(pages.shape)}" if isinstance(pages, Tensor) else type(pages)
        raise fmt.PageCompError(f"pagecomp.{op}_into: pages must be uint8 [N, P], got {desc}")
    fmt.check_decompress_args(payload, offsets, sizes, kinds, pages.shape[1], pages, status,
                              op=f"{op}_into")
    if not _use_triton(payload):
        got, st = _reference(_decompress_exp_ref if exp else _decompress_ref,
                             getattr(torch.ops.pagecomp, op), payload, offsets, sizes, kinds,
                             pages.shape[1])
        pages.copy_(got)
        status.copy_(st)
        return
    if exp:
        from .kernels.exp_codec import decompress_exp_into as launch_into
    else:
        from .kernels.lz4_decompress import decompress_into as launch_into

    launch_into(payload, offsets, sizes, kinds, pages, status, traced=False)


def compress_exp_eager(pages: Tensor, float_format: str) -> tuple[Tensor, Tensor, Tensor]:
    """As ``torch.ops.pagecomp.compress_exp``."""
    fmt.check_compress_exp_args(pages, float_format)
    if not _use_triton(pages):
        return _reference(_compress_exp_ref, torch.ops.pagecomp.compress_exp, pages,
                          float_format)
    from .kernels.exp_codec import compress_exp_pages

    return compress_exp_pages(pages, float_format == "fp16", traced=False)


def decompress_exp_eager(
    payload: Tensor, offsets: Tensor, sizes: Tensor, kinds: Tensor, page_size: int
) -> tuple[Tensor, Tensor]:
    """As ``torch.ops.pagecomp.decompress_exp``."""
    fmt.check_decompress_args(payload, offsets, sizes, kinds, page_size, op="decompress_exp")
    if not _use_triton(payload):
        return _reference(_decompress_exp_ref, torch.ops.pagecomp.decompress_exp, payload,
                          offsets, sizes, kinds, page_size)
    from .kernels.exp_codec import decompress_exp_pages

    return decompress_exp_pages(payload, offsets, sizes, kinds, page_size, traced=False)


def compress_codec_eager(pages: Tensor, element_size: int,
                         float_format: str | None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`compress_exp_eager` with ``float_format`` (``"bf16"`` / ``"fp16"``), else
    :func:`compress_eager` by ``element_size``: the codec a stored tensor's
    ``float_format`` names (``storage.Storage``, the activation store)."""
    if float_format is not None:
        return compress_exp_eager(pages, float_format)
    return compress_eager(pages, element_size)
