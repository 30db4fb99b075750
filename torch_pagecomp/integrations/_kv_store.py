"""Where a compressed KV cache keeps its sealed blocks: one store per device, shared by a cache
and its copies (``torch_pagecomp.integrations.transformers``).

On CUDA (and on the CPU under the Triton interpreter, as in the tests) the store is the
kernel-only :class:`~torch_pagecomp.offload._paged.PagedStore`: a block is compressed and
packed into page-locked host chunks by kernels on two side streams, and a layer's blocks come
back together (``restore_group``) on a third, the restore stream, which the compute stream
waits for through an event (the restore stream never waits for the compute stream). Without
the interpreter a CPU device uses the CPU codecs (:class:`_CpuBlockStore`), one block at a
time.

A stored block is held by :class:`Held` objects shared by the cache layers that contain it;
when the last goes, the block is queued in the store's ``sink`` and freed at the cache's next
call (never from a destructor, which may run in the middle of the store's own bookkeeping).
"""

from __future__ import annotations

import torch

from .. import exp_codec
from .._events import mark
from ..format import CorruptPageError
from ..kernels.launch import interpreting
from ..offload._paged import PagedStore, free_each
from ..offload._paged_group import StoredGroup
from ..offload._stores import CpuStore
from ..offload._streams import current_stream, on_stream


class Held:
    """One holder of a stored block; the block is freed once no holder is left."""

    __slots__ = ("stored", "sink")

    def __init__(self, stored, sink: list):
        self.stored, self.sink = stored, sink

    def __del__(self):
        self.sink.append(self.stored)  # a list append: safe wherever the collector runs


class _CpuBlockStore:
    """A CPU device without the Triton interpreter: blocks through the CPU codecs (the
    exponent codec for bf16 where its loops are SIMD, else LZ4)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._cpu = CpuStore(compress=True, page_size=page_size)
        self.used = self.peak = 0  # host bytes of the live blocks (exact), and their most

    def offload(self, src: torch.Tensor, element_size: int, producer=None,
                float_format: str | None = None):
        # ``float_format`` is given under the cache's "auto": the host's rule for it (the
        # exponent codec for bf16 where its C loops are SIMD, else LZ4 bit-shuffled)
        stored = self._cpu.offload(src, element_size, exp_codec.host_auto_format(float_format))
        self.used += stored.host_nbytes()
        self.peak = max(self.peak, self.used)
        return stored

    def restore_group(self, group: StoredGroup, out: torch.Tensor) -> None:
        for stored, start in zip(group.storeds, group.starts):
            self._cpu.restore(stored, out[start:start + stored.nbytes])

    def free(self, stored) -> None:
        if not stored.freed:
            nbytes = stored.host_nbytes()
            self._cpu.free(stored)
            self.used -= nbytes  # (after the free: one that raised is tried again as it was)

    def free_after_restores(self, storeds: list) -> None:
        free_each(storeds, self.free)  # (restores here are done on return)

    def poll(self) -> None:
        pass

    def wait_placed(self) -> None:
        pass

    def release_scratch(self) -> None:
        pass  # the CPU codecs keep no scratch

    def failed_restores(self) -> int:
        return 0  # a CPU restore raises at once

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"host_used_bytes": self.used, "host_held_bytes": self.used,
                "host_peak_held_bytes": self.peak, "host_peak_used_bytes": self.peak}


class DeviceStore:
    """The block store of one device (see the module docstring).

    ``side`` is the restore stream on CUDA (``None`` on the CPU); restores must run on it,
    so that a host chunk is reused only after the restores that read it.
    """

    def __init__(self, device: torch.device, page_size: int):
        self.device, self.page_size = device, page_size
        self.sink: list = []
        self.side = None
        # a block's page metadata lives on the host once it is placed, in the arena behind its
        # pages (it lives as long as the block; on the GPU it would grow with the context, 13
        # bytes a page)
        if device.type == "cuda":
            streams = tuple(torch.cuda.Stream(device=device) for _ in range(3))
            self.side = streams[2]
            self.store = PagedStore(device, page_size, streams)
        elif interpreting():
            self.store = PagedStore(device, page_size)
        else:
            self.store = _CpuBlockStore(page_size)
        self.closed = False

    def seal(self, src: torch.Tensor, element_size: int, float_format: str | None = None
             ) -> Held:
        """Store ``src`` (``uint8 [n]`` on this device, contiguous) after the current stream's
        work, with the exponent codec where ``float_format`` (``"bf16"`` / ``"fp16"``) says
        what it holds; the caller keeps ``src`` unchanged until the store has read it (see
        :meth:`keep_until_read`)."""
        producer = current_stream(src.device) if src.is_cuda else None
        return Held(self.store.offload(src, element_size, producer=producer,
                                       float_format=float_format), self.sink)

    def keep_until_read(self, src: torch.Tensor) -> None:
        """``src``'s memory is not reused before the compress stream has read it."""
        if src.is_cuda:
            src.record_stream(self.store.compress_stream)

    def release_scratch(self) -> None:
        """Free the compress kernel's scratch (made again by the next seal): a cache seals a
        few blocks a layer every ``block_tokens`` tokens, so keeping it would hold GPU memory
        for the life of the cache, beside every layer's tail."""
        self.store.release_scratch()

    def restore(self, group: StoredGroup) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """``(out, event)``: ``group`` restored into a new ``uint8 [group.nbytes]`` buffer on
        the restore stream. The restore waits only for the blocks' own packs, never for the
        compute stream, so the link can run ahead of the model; a stream that reads ``out``
        first calls :meth:`use`. ``event`` is ``None`` on the CPU (done on return)."""
        if self.side is None:
            out = torch.empty(group.nbytes, dtype=torch.uint8, device=self.device)
            self.store.restore_group(group, out)
            return out, None
        with on_stream(self.side):  # out is the restore stream's: nothing else wrote it
            out = torch.empty(group.nbytes, dtype=torch.uint8, device=self.device)
            self.store.restore_group(group, out)
            return out, mark(self.side)

    @staticmethod
    def use(out: torch.Tensor, event: torch.cuda.Event | None) -> None:
        """The current stream waits for ``out``'s restore, and ``out``'s memory is reused
        only after what the current stream queues on it until it is dropped."""
        if event is not None:
            stream = current_stream(out.device)
            stream.wait_event(event)
            out.record_stream(stream)

    def drain(self) -> None:
        """Free the blocks no cache holds any more."""
        if not self.sink or self.closed:
            return
        self.store.free_after_restores(self.sink)

    def check(self) -> None:
        """Raise if restores so far decoded pages that failed (as far as the host knows: the
        count is read without waiting, so a failure shows up a step or so late)."""
        bad = self.store.failed_restores()
        if bad:
            raise CorruptPageError([], [], f"{bad} compressed KV cache page(s) failed to decode")

    def close(self) -> None:
        """Free the queued blocks and unpin the host memory (waits for the streams)."""
        if self.closed:
            return
        self.drain()
        self.store.close()
        self.closed = True


class Stores:
    """The device stores of a cache and of its copies: closed when the last of them closes
    (or is collected)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.by_device: dict[torch.device, DeviceStore] = {}
        self.users = 0

    def get(self, device: torch.device) -> DeviceStore:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cuda":
            device = torch.device("cpu")
        ds = self.by_device.get(device)
        if ds is None:
            ds = self.by_device[device] = DeviceStore(device, self.page_size)
        return ds

    def release(self) -> None:
        """One user fewer; the last one closes every store."""
        self.users -= 1
        if self.users <= 0:
            for ds in self.by_device.values():
                try:
                    ds.close()
                except RuntimeError:  # a CUDA context already torn down: nothing to wait for
                    pass
