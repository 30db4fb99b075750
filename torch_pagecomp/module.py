"""``PageCompressor``: offload tensors to compressed host storage and restore them, async.

    pc = PageCompressor()                      # current CUDA device, else the CPU
    h = pc.offload(kv)                         # returns at once; ordered after the caller's stream
    ...
    kv2 = pc.restore(h)                        # ordered on the caller's stream, no host sync
    h.free()

Use it as a context manager (``with PageCompressor() as pc:``) or call :meth:`close`: either
finishes the queued work and joins the worker threads; at interpreter exit every live one is
closed anyway (``pipeline._close_all_at_exit``, and ``_direct``'s for the kernel-only store).
A copy (``copy.deepcopy``, pickling, e.g. by ``torch.save`` of a model holding one) is a fresh
``PageCompressor`` with the same settings and nothing offloaded.

The host keeps only the packed compressed pages (exact sizes, in a pinned arena on a GPU), so
host memory shrinks with the ratio; incompressible pages are kept raw (never larger than the
input plus ~13 bytes of metadata per page).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch

from . import exp_codec
from . import format as fmt
from ._args import as_int, check_flag, check_number
from ._events import mark
from .api import raise_for_status
from .format import PageCompError, dtype_element_size
from .handles import OffloadHandle, RestoreFailures, _bytes_of, _checked, _page_sums
from .offload._streams import current_stream
from .pipeline import Pipeline, PipelineStopped, SlotState  # noqa: F401 (re-exported)
from .storage import Storage
from .timing import overlapping_slots

CODECS = ("auto", "lz4", "exp")  # what PageCompressor(codec=...) takes
# A compressor without a GPU stores host tensors up to this size during ``offload`` itself:
# the hand-offs to its worker threads and back cost ~0.7 ms, more than the codec's work on
# them (bench/results/cpu2_77d03ac_inline).
INLINE_HOST_BYTES = 1 << 20


def default_batch_pages(device: torch.device, page_size: int) -> int:
    """Pages per batch: ~512 KiB per multiprocessor (8..64 MiB, <= 1/256 of the card's
    memory) on a GPU; 1 MiB on the CPU. A batch fills the card several times over and its
    kernel outlasts the host's work to issue it (with much smaller batches a restore is bound
    by the host's launch time), while three slots stay small."""
    if device.type != "cuda":
        return max(1, (1 << 20) // page_size)
    props = torch.cuda.get_device_properties(device)
    target = min(max(props.multi_processor_count * (512 << 10), 8 << 20), 64 << 20)
    target = min(target, props.total_memory // 256)
    return max(1, target // page_size)


def _on_device(device: torch.device):
    """``torch.cuda.device(device)`` for a CUDA device other than the current one; nothing for
    the current one (the usual case: the context costs microseconds a call) or the CPU."""
    if device.type != "cuda" or device.index == torch._C._cuda_getDevice():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _not_capturing(what: str) -> None:
    if torch.cuda.is_current_stream_capturing():
        raise PageCompError(
            f"{what} cannot run inside CUDA graph capture (it waits on the host for sizes); "
            "call it outside the captured region"
        )


def _device_arg(value, name: str = "device") -> torch.device:
    """``value`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device`` or an index) as a
    cpu or cuda device, with ``cuda`` resolved to the current one; anything else, or cuda
    where this torch has none, is an error naming it."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise PageCompError(
            f"{name} must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {value!r}"
        ) from None
    if device.type not in ("cuda", "cpu"):
        raise PageCompError(f"{name} must be a cuda or cpu device, got {device}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise PageCompError(
                f"{name} is {device}, but CUDA is not available here "
                "(torch.cuda.is_available() is False): use device='cpu'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():  # (torch's own error comes later,
            # from deep inside the first allocation, and names no argument)
            raise PageCompError(f"{name} is {device}, but this process sees "
                                f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def _element_size_arg(value) -> int:
    es = as_int("element_size", value)
    fmt.check_element_size(es)
    return es


def _check_offloadable(tensor) -> None:
    """Refuse, up front and by name, tensors whose bytes are not one dense buffer that the
    pipeline can read: left to the worker threads they crashed there (quantized) or failed
    only at restore (meta)."""
    if not isinstance(tensor, torch.Tensor):
        raise PageCompError(f"offload takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_quantized:
        raise PageCompError(
            f"cannot offload a quantized tensor ({tensor.dtype}): offload its int_repr() and "
            "keep its quantization parameters, or dequantize() it"
        )
    if tensor.is_nested:
        raise PageCompError("cannot offload a nested tensor: offload its components")
    if tensor.layout != torch.strided:
        raise PageCompError(
            f"cannot offload a {tensor.layout} tensor: only dense (torch.strided) tensors; "
            "use .to_dense(), or offload its indices and values"
        )
    if tensor.device.type == "meta":
        raise PageCompError("cannot offload a meta tensor: it has no data")
    if tensor.device.type not in ("cpu", "cuda"):
        raise PageCompError(f"cannot offload a tensor on {tensor.device}: only cpu and cuda")


def _check_block_ids(ids: torch.Tensor, num_blocks: int, distinct: bool = False) -> None:
    """Out-of-range block ids raise here, naming the id: on a GPU, ``index_select`` would
    report them by a device-side assert that ends the process's CUDA context. With
    ``distinct`` (a restore writes each block once: ``index_copy_`` with a repeated id keeps
    one of the rows meant for it, which one is undefined, and drops the other) a repeated id
    raises too, naming the block. Ids on the host are checked for free; ids on a GPU cost one
    host sync (their min, max and whether any repeats), which ``offload_blocks`` /
    ``restore_blocks`` accept: they wait on the host anyway."""
    if ids.numel() == 0:
        return
    if distinct:  # sorted: the ends are the min and max, a repeat sits beside its twin
        s = ids.sort().values
        same = s[1:] == s[:-1]
        read = [s[0], s[-1], same.any().to(s.dtype)]
    else:
        read = [ids.min(), ids.max()]
    lo, hi, *repeats = torch.stack(read).tolist()  # the one host sync
    if lo < 0 or hi >= num_blocks:
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise PageCompError(
            f"block id {bad} is out of range for a cache of {num_blocks} blocks along its "
            f"block dim (valid ids: 0..{num_blocks - 1})"
        )
    if any(repeats):
        raise PageCompError(
            f"block_ids repeat block {int(s[1:][same][0])}: restore_blocks writes each block "
            "once (a repeated id would keep one of the rows meant for it and drop the other)"
        )


def _rebuild_compressor(init_kwargs: dict, training: bool) -> PageCompressor:
    """Unpickle (or copy) a :class:`PageCompressor`: a fresh one with the same settings."""
    pc = PageCompressor(**init_kwargs)
    pc.train(training)
    return pc


class PageCompressor(torch.nn.Module):
    """Compressed offload of GPU tensors to host memory.

    A tensor on this GPU of at most one batch (``batch_pages`` pages) goes to a kernel-only
    store (``torch_pagecomp._direct``: compress and pack kernels on side streams write the
    pages straight into page-locked host memory; no thread, no host wait: a small call costs
    a quarter of the ring's, ``bench/results/h200_336d109_direct/``). Larger tensors and host
    tensors go through a ring of ``slots`` slots whose worker threads overlap upload, kernel
    and download of successive batches; ``max_pinned_bytes``, ``raw_bypass`` and
    ``max_raw_share`` are the ring's.

    Args:
        device: the GPU that compresses (``None``: the current CUDA device if any, else CPU).
        page_size: bytes per page (power of two, 4096..65536).
        batch_pages: pages per batch (``None``: :func:`default_batch_pages`).
        slots: batches in the ring at once (3: upload, kernel and download overlap); up to
            as many more offload batches may be downloading outside it (their device buffers
            held), so the kernels need not wait for the link. The kernel-only store holds at
            most ``slots`` batches' bytes of offloads not yet packed (the host waits beyond).
        max_pinned_bytes: bound on the uncompressed bytes of offload batches in flight
            (pinned landing space); producers wait beyond it. ``None``: slots bound it alone.
        element_size: bit-shuffle width (1, 2, 4) for every tensor (``None``: per dtype).
        raw_bypass: on a GPU, once a stream of tensors (same dtype and element size) stops
            compressing, store its batches raw with a plain copy, probing every 16th batch
            (see ``cuda_stages.RawBypass``): incompressible data moves at pinned-copy speed.
        max_raw_share: on a GPU, the largest share of batches stored raw to keep the copy
            engine busy while the kernel is the bottleneck: 0 (default) puts ratio first, 1
            speed first (host memory then shrinks less).
        stream_priority: CUDA priority of the compressor's streams (lower is higher, clamped to
            the device's range, 0 down to a few negative levels): with a negative value its
            kernels' thread blocks are scheduled ahead of default-priority work queued beside
            them. (It matters only where the kernels run beside the model's; in a link-bound
            step they rarely do.)
        checksum: keep the format's checksum of every page of each offloaded tensor (computed
            from the source on the caller's stream: one more read of it; 4 bytes per page,
            kept on the source's device) and check each restore against them: a page that
            decodes without error to other bytes fails with ``STATUS_CHECKSUM``, raised by
            ``restore(..., check=True)`` and on the CPU, else counted by
            :meth:`failed_restores`.
        codec: how the pages of bf16 / fp16 tensors are coded (other dtypes always take LZ4,
            bit-shuffled by ``element_size``): ``"auto"`` (default) the exponent codec
            (``compress(..., codec="exp-bf16")``: ~1.42x on typical bf16 where LZ4 stores
            1.2-1.4x) when the pages go through the GPU's kernels, and for bf16 on a CPU
            compressor whose C loops are SIMD (x86: as fast as LZ4 there); LZ4 + bit-shuffle
            for the rest of a CPU compressor's (fp16, where LZ4 decodes faster; other CPUs);
            ``"exp"`` the exponent codec always; ``"lz4"`` LZ4 + bit-shuffle always (what
            ``lz4.block`` reads). A tensor offloaded with an explicit ``element_size`` other
            than 2 takes LZ4 with that width.

    A copy or an unpickled one is a fresh ``PageCompressor`` built from these same arguments
    (``device=None`` resolves again where it is built), with nothing offloaded. ``with
    PageCompressor() as pc:`` closes it on leaving the block.
    """

    def __init__(
        self,
        device=None,
        page_size: int = fmt.DEFAULT_PAGE_SIZE,
        batch_pages: int | None = None,
        slots: int = 3,
        max_pinned_bytes: int | None = None,
        element_size: int | None = None,
        raw_bypass: bool = True,
        max_raw_share: float = 0.0,
        stream_priority: int = 0,
        checksum: bool = False,
        codec: str = "auto",
    ):
        super().__init__()
        init_kwargs = dict(
            device=device, page_size=page_size, batch_pages=batch_pages, slots=slots,
            max_pinned_bytes=max_pinned_bytes, element_size=element_size,
            raw_bypass=raw_bypass, max_raw_share=max_raw_share, stream_priority=stream_priority,
            checksum=checksum, codec=codec,
        )
        check_flag("checksum", checksum)
        if codec not in CODECS:
            raise PageCompError(f"codec must be one of {CODECS}, got {codec!r}")
        self.checksum = checksum
        self.codec = codec
        page_size = as_int("page_size", page_size)
        slots = as_int("slots", slots)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = _device_arg(device)
        fmt.check_page_size(page_size)
        if element_size is not None:
            element_size = _element_size_arg(element_size)
        if batch_pages is None:
            batch_pages = default_batch_pages(device, page_size)
        batch_pages = as_int("batch_pages", batch_pages)
        if batch_pages < 1:
            raise PageCompError(f"batch_pages must be >= 1, got {batch_pages}")
        if max_pinned_bytes is not None:
            max_pinned_bytes = as_int("max_pinned_bytes", max_pinned_bytes)
            if max_pinned_bytes < page_size:
                raise PageCompError(
                    f"max_pinned_bytes must be >= page_size, got {max_pinned_bytes}")
        check_flag("raw_bypass", raw_bypass)
        check_number("max_raw_share", max_raw_share, 0.0, 1.0)
        stream_priority = as_int("stream_priority", stream_priority)
        self._init_kwargs = init_kwargs
        self._stream_priority = stream_priority
        self._direct = None  # the kernel-only store of small GPU tensors (made on first use)
        self._small_tensor = None  # its one-call path (``_small_tensor``), made with it
        self._direct_lock = threading.Lock()
        self.device = device
        self.page_size = page_size
        self.element_size = element_size
        self.max_pinned_bytes = max_pinned_bytes
        self.pipeline = Pipeline(
            device, page_size, batch_pages, slots, max_pinned_bytes, raw_bypass=raw_bypass,
            max_raw_share=max_raw_share, stream_priority=stream_priority,
        )
        self.batch_pages = self.pipeline.batch_pages
        self.counts = {"offloads": 0, "restores": 0, "bytes_in": 0, "bytes_restored": 0}
        self._counts_lock = threading.Lock()
        self.restore_failures = RestoreFailures(device) if self.pipeline.cuda else None
        # collected without close(): only queue the threads' end (a finalizer may run on one of
        # them); the atexit handler joins whatever is still running
        weakref.finalize(self, functools.partial(self.pipeline.close, wait=False))

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> PageCompressor:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __reduce_ex__(self, protocol):
        """Copies and pickles are fresh compressors with the same settings: threads, locks,
        streams and host memory belong to one process and one object, and offloaded data
        lives in handles, not in the module."""
        return _rebuild_compressor, (dict(self._init_kwargs), self.training)

    # ------------------------------------------------------------------ offload
    def offload(self, tensor: torch.Tensor, element_size: int | None = None) -> OffloadHandle:
        """Start compressing ``tensor`` (any dtype/shape, on this GPU or the host) to the host.

        Returns at once (unless back-pressure makes it wait for earlier batches). The reads of
        ``tensor`` are ordered after the work queued so far on the caller's current stream; the
        tensor is kept alive (and ``record_stream``-ed) until read. Do not modify it in place
        before ``handle.ready()``; :meth:`offload_blocks` takes a snapshot instead. Without a
        GPU, a tensor of at most ``INLINE_HOST_BYTES`` (1 MiB) is stored before this returns
        (compressed on the calling thread, its handle ready).
        """
        if self._small_tensor is not None and element_size is None:
            handle = self._small_tensor.offload(tensor)
            if handle is not None:
                return handle
        _check_offloadable(tensor)
        self.pipeline.check_usable()
        if element_size is not None:
            es = _element_size_arg(element_size)
        else:
            es = self.element_size or dtype_element_size(tensor.dtype)
        tensor = tensor.detach().resolve_conj().resolve_neg()  # the bits of the values
        cuda = self.pipeline.cuda
        if tensor.device.type == "cuda" and (not cuda or tensor.device != self.device):
            if cuda:
                raise PageCompError(f"tensor is on {tensor.device}, this module on {self.device}")
            tensor = tensor.cpu()
        flat = tensor.contiguous()
        src = _bytes_of(flat)
        nbytes = src.numel()
        float_format = self._float_format(tensor.dtype, es)
        if self._takes_direct(flat, nbytes):
            if flat.is_cuda:
                _not_capturing("offload")
            with _on_device(self.device):
                storage = self._direct_path().offload(src, es, float_format)
        else:
            storage = Storage(self.pipeline.arena, check=self.pipeline.check_alive,
                              float_format=float_format)
        handle = OffloadHandle(storage, tensor.shape, tensor.dtype, nbytes, self.page_size, es)
        self._count(offloads=1, bytes_in=nbytes)
        if storage.direct:  # queued already
            return handle
        if nbytes == 0:
            storage.close()
            return handle
        if self.checksum:  # on the caller's stream, before anything may change the source
            handle.checksums = _page_sums(src, self.page_size)
        if not cuda and nbytes <= INLINE_HOST_BYTES:  # stored when this returns
            self.pipeline.compress_now(storage, src, nbytes, es)
            return handle
        if cuda:
            _not_capturing("offload")
            with torch.cuda.device(self.device):
                producer = torch.cuda.current_stream(self.device)  # the caller's, read here
                ready = mark(producer)
                if flat.is_cuda:  # read by the kernels, or by raw downloads
                    flat.record_stream(self.pipeline.compute)
                    flat.record_stream(self.pipeline.d2h)
                    flat.record_stream(self.pipeline.d2h_raw)
                key = (tensor.dtype, es)
                self.pipeline.submit_compress(
                    storage, src, nbytes, es, ready, keep=(flat,), key=key
                )
        else:
            self.pipeline.submit_compress(storage, src, nbytes, es, keep=(flat,))
        return handle

    def _takes_direct(self, flat: torch.Tensor, nbytes: int) -> bool:
        """Whether a tensor goes to the kernel-only store (``torch_pagecomp._direct``) rather
        than the ring: a tensor on this GPU of one batch or less, which gains nothing from the
        ring's overlap of batches and would pay its threads' hand-offs (~1.5 ms a call)."""
        return (self.pipeline.cuda and flat.is_cuda
                and 0 < nbytes <= self.batch_pages * self.page_size)

    def _direct_path(self):
        if self._direct is None:
            from ._direct import DirectPath

            with self._direct_lock:
                if self._direct is None:
                    slots = len(self.pipeline.slots)
                    direct = DirectPath(
                        self.device, self.page_size, self._stream_priority, self.checksum,
                        max_in_flight=slots * self.batch_pages * self.page_size)
                    # where this compressor's rule gives both 16-bit types the exponent codec
                    es = self.element_size or 2
                    if (direct.small is not None
                            and self._float_format(torch.bfloat16, es) == "bf16"
                            and self._float_format(torch.float16, es) == "fp16"):
                        from ._small_tensor import SmallTensorPath

                        self._small_tensor = SmallTensorPath(self, direct)
                    self._direct = direct
        return self._direct

    def _float_format(self, dtype: torch.dtype, element_size: int) -> str | None:
        """The exponent codec's layout for a tensor of ``dtype`` offloaded with
        ``element_size`` (see ``codec``), or None: LZ4."""
        if element_size != 2 or self.codec == "lz4":
            return None
        layout = fmt.DTYPE_FLOAT_FORMATS.get(dtype)
        if self.codec == "auto" and not self.pipeline.cuda:
            return exp_codec.host_auto_format(layout)
        return layout

    def compress_host(self, pages: torch.Tensor, element_size: int = 1) -> OffloadHandle:
        """Compress host memory on this module's device and keep it packed on the host: the
        host batch flow (upload, kernel, download). ``handle.compressed()`` gives the pages
        as a packed ``CompressedPages``; ``restore(handle, device="cpu")`` the bytes back."""
        _check_offloadable(pages)
        if pages.device.type != "cpu":
            raise PageCompError(f"compress_host takes a host tensor, got {pages.device}")
        return self.offload(pages, element_size)

    def offload_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor,
                       dim: int = 0) -> OffloadHandle:
        """Offload the blocks ``block_ids`` of ``cache`` along ``dim`` (e.g. ``dim=1`` for a
        ``[layers, blocks, ...]`` cache). The gather runs on the caller's stream (a snapshot in
        stream order), so the caller may overwrite those blocks right away."""
        dim = self._block_dim(cache, dim)
        ids = self._block_ids(cache, block_ids, dim)
        return self.offload(cache.index_select(dim, ids))

    # ------------------------------------------------------------------ restore
    def restore(
        self,
        handle: OffloadHandle,
        device=None,
        out: torch.Tensor | None = None,
        check: bool = False,
    ) -> torch.Tensor:
        """Decompress ``handle`` bit-exactly into a new tensor (or ``out``) on ``device``.

        On this GPU the writes are ordered on the caller's current stream (usable at once in
        stream order, no host sync); a tensor of more than one batch waits on the host until
        its offload is stored (one of one batch or less never waits: its decode waits on the
        device). ``check=True`` verifies every page's decode status (a host sync on a GPU;
        always done on the CPU).
        """
        if self._small_tensor is not None and device is None and not check:
            got = self._small_tensor.restore(handle, out)
            if got is not None:
                return got
        return self._restore(handle, device, out, check)

    def _restore(self, handle: OffloadHandle, device, out: torch.Tensor | None, check: bool,
                 count: bool = True) -> torch.Tensor:
        """:meth:`restore` past the small-tensor path; ``count=False``: not counted in
        ``counts`` (a restore that goes through host memory, counted by its caller)."""
        if not isinstance(handle, OffloadHandle):
            raise PageCompError(f"restore takes an OffloadHandle, got {type(handle).__name__}")
        if not handle._free.alive:
            raise PageCompError("this handle was freed")
        if handle.page_size != self.page_size:
            raise PageCompError(
                f"this handle was stored with page_size={handle.page_size}, this "
                f"PageCompressor has page_size={self.page_size}: restore it with one of "
                f"page_size={handle.page_size}"
            )
        self.pipeline.check_usable(closed_ok=True)
        direct = handle._storage.direct  # stored by the kernel-only store (see offload)
        # the store that holds its pages: the handle's own, which is another compressor's for
        # a handle offloaded there (this one's store would decode its own arena's bytes at the
        # handle's places: another tensor's, or garbage)
        path = handle._storage.path if direct else None
        if not direct:
            handle.wait()
        if device is not None:
            device = _device_arg(device)
        if out is not None:
            if not isinstance(out, torch.Tensor):
                raise PageCompError(f"out must be a torch.Tensor, got {type(out).__name__}")
            if out.device.type not in ("cpu", "cuda"):
                raise PageCompError(f"out must be on a cpu or cuda device, got {out.device}")
            target = out.device if device is None else device
            if (out.shape, out.dtype, out.device) != (handle.shape, handle.dtype, target):
                raise PageCompError(
                    f"out must be {tuple(handle.shape)} {handle.dtype} on {target}, got "
                    f"{tuple(out.shape)} {out.dtype} on {out.device}"
                )
            if not out.is_contiguous():
                raise PageCompError("out must be contiguous")
            # its bits would read back conjugated or negated (the decode writes bytes; torch
            # refuses their byte view with an error that names no argument)
            if out.is_conj() or out.is_neg():
                raise PageCompError(
                    f"out must not be a {'conjugate' if out.is_conj() else 'negative'} view: "
                    "restore into a plain tensor (and .conj() or .neg() the result)"
                )
        else:
            target = self.device if device is None else device
            out = torch.empty(handle.shape, dtype=handle.dtype, device=target)
        if count:
            self._count(restores=1, bytes_restored=handle.nbytes)
        if handle.nbytes == 0:
            return out
        dst = _bytes_of(out)
        if (target.type == "cuda" and self.pipeline.cuda and target == self.device
                and (path is None or path.device == self.device)):
            _not_capturing("restore")
            with _on_device(self.device):
                consumer = current_stream(self.device)
                if direct:
                    statuses = [path.restore_into(handle._storage, dst)]
                else:
                    statuses = self.pipeline.submit_decompress(handle._storage, dst, consumer)
                if handle.checksums is not None and statuses:
                    for s in statuses:
                        s.record_stream(consumer)  # made on the kernel stream, read here
                    statuses = [_checked(torch.cat(statuses), dst, handle)]
            if check and statuses:
                raise_for_status(torch.cat(statuses))
            elif statuses:  # counted on the device: see failed_restores()
                # (the kernel-only path's statuses are kept for the caller's stream already)
                self.restore_failures.add(statuses, consumer,
                                          recorded=direct and handle.checksums is None)
        elif target.type == "cpu" and direct:  # decoded on its store's GPU, then copied down
            with _on_device(path.device):
                on_device = torch.empty(handle.nbytes, dtype=torch.uint8, device=path.device)
                status = path.restore_into(handle._storage, on_device)
                dst.copy_(on_device)
            raise_for_status(status.cpu())
        elif target.type == "cpu":
            statuses = self.pipeline.cpu_decompress(handle._storage, dst)
            if statuses:  # one status per page, in page order: errors name global pages
                status = torch.cat(statuses)
                if handle.checksums is not None:
                    status = _checked(status, dst, handle)
                raise_for_status(status)
        else:
            # decoded into host memory, then copied up: one restore, counted above (the
            # nested call counted it a second time)
            host = self._restore(handle, torch.device("cpu"), None, False, count=False)
            out.copy_(host)
        return out

    def restore_blocks(
        self, handle: OffloadHandle, cache: torch.Tensor, block_ids: torch.Tensor, dim: int = 0
    ) -> None:
        """Scatter a handle from :meth:`offload_blocks` into the blocks ``block_ids`` of
        ``cache`` along ``dim``, ordered on the caller's current stream."""
        if not isinstance(handle, OffloadHandle):  # (its shape is read before restore's check)
            raise PageCompError(
                f"restore_blocks takes an OffloadHandle, got {type(handle).__name__}")
        dim = self._block_dim(cache, dim)
        ids = self._block_ids(cache, block_ids, dim, distinct=True)
        want = list(cache.shape)
        want[dim] = ids.numel()
        if tuple(handle.shape) != tuple(want) or handle.dtype != cache.dtype:
            raise PageCompError(
                f"handle holds {tuple(handle.shape)} {handle.dtype}, the blocks of cache along "
                f"dim {dim} are {tuple(want)} {cache.dtype}"
            )
        cache.index_copy_(dim, ids, self.restore(handle, device=cache.device))

    @staticmethod
    def _block_dim(cache: torch.Tensor, dim: int) -> int:
        _check_offloadable(cache)
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise PageCompError(f"dim must be an int, got {dim!r}")
        if not -cache.dim() <= dim < cache.dim():
            raise PageCompError(f"dim {dim} is out of range for a cache of {cache.dim()} dims")
        return dim % cache.dim()

    @staticmethod
    def _block_ids(cache: torch.Tensor, block_ids: torch.Tensor, dim: int = 0,
                   distinct: bool = False) -> torch.Tensor:
        if cache.dim() < 1:
            raise PageCompError("cache must have a block dimension")
        try:
            ids = torch.as_tensor(block_ids)
        except (RuntimeError, TypeError, ValueError):
            raise PageCompError(
                f"block_ids must be a 1-D int tensor or a sequence of ints, got "
                f"{type(block_ids).__name__}") from None
        if ids.device.type not in ("cpu", "cuda"):
            raise PageCompError(f"block_ids must be on a cpu or cuda device, got {ids.device}")
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
            raise PageCompError(f"block_ids must be 1-D int32/int64, got {ids.dtype} {ids.shape}")
        if ids.is_cuda:
            _not_capturing("a GPU tensor of block_ids")  # the range check reads them
        _check_block_ids(ids, cache.shape[dim], distinct)
        return ids.to(device=cache.device, dtype=torch.int64)

    # ------------------------------------------------------------------ introspection
    def slot_states(self) -> list[SlotState]:
        return self.pipeline.states()

    def synchronize(self) -> None:
        """Wait until every batch queued so far completed."""
        self.pipeline.drain()
        if self._direct is not None:
            self._direct.synchronize()

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued work, stop and join the worker threads, release idle pooled memory
        (``timeout``: at most that many seconds; returns whether the threads stopped).

        Offloads waiting in other threads raise :class:`PipelineStopped` at once, and so does
        every later offload; stored handles stay readable (restore to the CPU). Also done on
        leaving a ``with`` block and, for compressors still open, at interpreter exit."""
        stopped = self.pipeline.close(timeout=timeout)
        if self._direct is not None:  # no thread: its streams finish, idle chunks unpinned
            self._direct.shut_down()  # (and the others as their handles are freed)
        return stopped

    def _count(self, **inc: int) -> None:
        with self._counts_lock:  # offload/restore may be called from several threads
            for k, v in inc.items():
                self.counts[k] += v

    def timeline(self) -> list[dict]:
        """The last batches' stage intervals (ms from the pipeline epoch), slot and bytes."""
        return self.pipeline.timing.timeline()

    def reset_timing(self) -> None:
        self.pipeline.timing.reset()

    def empty_cache(self) -> int:
        """Release idle pooled memory (empty arena chunks, idle staging and device buffers)."""
        p = self.pipeline
        freed = p.arena.trim()
        p.staging.clear()
        p.device_pool.clear()
        if self._direct is not None:
            freed += self._direct.release_idle()
        return freed

    def failed_restores(self, wait: bool = False) -> int:
        """Pages that failed to decode in GPU restores made without ``check=True``.

        ``wait=False`` never blocks and may lag by one call; ``wait=True`` counts every restore
        queued so far (a host sync). CPU restores always check, so this stays 0 there.
        """
        if self.restore_failures is None:
            return 0
        return self.restore_failures.total() if wait else self.restore_failures.poll()

    def stats(self) -> dict:
        """Counters, bytes held, pools and stage times (ms, sums over batches)."""
        p = self.pipeline
        arena, staging, dev = p.arena.stats(), p.staging.stats(), p.device_pool.stats()
        timing = p.timing.summary()
        off, res = timing["offload"], timing["restore"]
        with self._counts_lock:
            stats = dict(self.counts)
        stats.update(
            device=str(self.device),
            codec=self.codec,
            page_size=self.page_size,
            batch_pages=self.batch_pages,
            slots=len(p.slots),
            bytes_held_host=arena["used_bytes"],
            ratio=off["bytes"] / off["stored"] if off["stored"] else 1.0,
            pinned_bytes_held=arena["pinned_bytes"] + staging["pinned_bytes"],
            host_pool_bytes=arena["held_bytes"] + staging["held_bytes"],
            device_pool_bytes=dev["held_bytes"],
            pool_hits=arena["hits"] + staging["hits"] + dev["hits"],
            pool_misses=arena["misses"] + staging["misses"] + dev["misses"],
            pools={"arena": arena, "staging": staging, "device": dev},
            failed_restores=self.failed_restores(),
            inflight_bytes=p.limiter.in_flight,
            inflight_max_bytes=p.limiter.max_seen,
            backpressure_waits=p.limiter.waits,
            raw_bypass_batches=p.bypass.raw_batches,
            raw_split_batches=p.bypass.split_batches,
            batches=off["batches"],
            upload_ms=off["upload_ms"],
            kernel_ms=off["kernel_ms"],
            download_ms=off["download_ms"],
            total_ms=off["total_ms"],
            bound_stage=off["bound"],
            restore_batches=res["batches"],
            restore_upload_ms=res["upload_ms"],
            restore_kernel_ms=res["kernel_ms"],
            restore_total_ms=res["total_ms"],
            slot_states=[s.value for s in p.states()],
            overlapping_stage_pairs=overlapping_slots(p.timing.timeline(last=32), window=8),
        )
        if self._direct is not None:  # tensors of one batch or less (see offload)
            d = stats["direct"] = self._direct.stats()
            stats["bytes_held_host"] += d["host_used_bytes"]
            stats["pinned_bytes_held"] += d["host_held_bytes"]
            stats["host_pool_bytes"] += d["host_held_bytes"]
            stats["device_pool_bytes"] += d["scratch_bytes"]  # the compress kernel's, bound
            stats["inflight_bytes"] += d["inflight_bytes"]
            stats["backpressure_waits"] += d["backpressure_waits"]
            kernel_in, kernel_out = off["bytes"] + d["bytes_in"], off["stored"] + d["bytes_stored"]
            stats["ratio"] = kernel_in / kernel_out if kernel_out else 1.0
        return stats

    def extra_repr(self) -> str:
        return (
            f"device={self.device}, page_size={self.page_size}, batch_pages={self.batch_pages}, "
            f"slots={len(self.pipeline.slots)}, max_pinned_bytes={self.max_pinned_bytes}, "
            f"codec={self.codec!r}"
        )
