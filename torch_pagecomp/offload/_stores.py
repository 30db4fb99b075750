"""Where offloaded activation storages go: pinned host buffers, compressed pages, CPU copies.

Every store turns the bytes of one storage (``uint8 [n]``) into a *stored* object and back:

* :class:`PinnedStore`: a plain copy into page-locked host memory carved at its exact size
  (``_copy_arena``), issued on the caller's current stream (the offloader runs it on its side
  stream).
* ``_paged.PagedStore``: compressed pages written by kernels into host memory (host
  bytes shrink with the ratio).
* :class:`CpuStore`: CPU tensors when there is no GPU: compressed by the CPU codecs, or copied.

:class:`ClassPolicy` samples the first tensors of each ``(dtype, shape)`` class and sends the
class to the pinned store when compression does not pay.
"""

from __future__ import annotations

import torch

from .. import cpu_codec
from .._events import mark
from .._ops import compress_cpu_direct
from ..format import CompressedPages
from ._copy_arena import CopyBlock, PinnedCopyArena
from ._streams import current_stream


# --------------------------------------------------------------------------------- stores
class RawStored:
    """A storage copied into page-locked memory; ``event`` marks the end of the copy."""

    kind = "raw"

    def __init__(self, buf: CopyBlock, event: torch.cuda.Event | None):
        self.buf = buf
        self.event = event

    def ready(self) -> bool:
        if self.event is not None and self.event.query():
            self.event = None  # done: the kept event (``_events.mark``) is not held any more
        return self.event is None

    source_read = ready  # the copy read the source: done

    def wait_on(self, stream: torch.cuda.Stream | None) -> None:
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)

    def host_nbytes(self) -> int:
        return self.buf.held_bytes


class PinnedStore:
    """Uncompressed offload: copy into the arena's page-locked memory on the current stream."""

    kind = "raw"

    def __init__(self, pool: PinnedCopyArena):
        self.pool = pool

    def offload(self, src: torch.Tensor, element_size: int) -> RawStored | None:
        stream = current_stream(src.device)
        buf = self.pool.get(src.numel(), stream)  # (the stream waits for its bytes' last use)
        if buf is None:
            return None
        try:
            buf.tensor.copy_(src, non_blocking=True)
            ev = mark(stream)
        except BaseException:
            # the caller never gets the block to free: given back here (else it stayed carved
            # for good, its chunk never unpinned), once a copy queued before the error is done
            try:
                if stream is not None:
                    stream.synchronize()
            finally:  # (a sticky CUDA error raises here too: the block goes back all the same)
                self.pool.put(buf)
            raise
        buf.last_use = ev
        return RawStored(buf, ev)

    def restore(self, stored: RawStored, out: torch.Tensor) -> None:
        stream = current_stream(out.device)
        stored.wait_on(stream)
        out.copy_(stored.buf.tensor, non_blocking=True)
        stored.buf.last_use = mark(stream)

    def free(self, stored: RawStored) -> None:
        self.pool.put(stored.buf)


class CpuStored:
    def __init__(self, kind: str, data, nbytes: int, host: int, exp: bool = False):
        self.kind, self.data, self.nbytes, self._host = kind, data, nbytes, host
        self.exp = exp  # the exponent codec's pages (else lz4 pages or a copy), as ``PagedStored``
        self.freed = False

    def ready(self) -> bool:
        return True

    def wait_on(self, stream) -> None:
        pass

    def host_nbytes(self) -> int:
        return self._host

    def kernel_bytes(self) -> tuple[int, int]:
        """``(page bytes, stored bytes)``, as the class policy reads a compressed offload."""
        return (self.nbytes, self._host)


class CpuStore:
    """CPU tensors (no GPU): lz4 pages packed exactly (``compress=True``; or with
    ``float_format``, the exponent codec's) or a plain copy."""

    def __init__(self, compress: bool, page_size: int = 4096, checksum: bool = False):
        self.compress = compress
        self.page_size = page_size
        self.checksum = checksum  # page checksums kept and checked (compressed only)
        self.kind = "compressed" if compress else "cpu"

    def offload(self, src: torch.Tensor, element_size: int,
                float_format: str | None = None) -> CpuStored:
        """Store ``src`` (``uint8 [n]``): lz4 pages bit-shuffled by ``element_size``, or with
        ``float_format`` (``"bf16"`` / ``"fp16"``) the exponent codec's pages. The codec's
        host loops themselves (the hooks' and the KV cache's arguments are valid by
        construction): whole pages compressed where they lie (only a partial last page is
        padded, in a copy), packed by the C loop into a buffer of the exact size."""
        n = src.numel()
        if not self.compress or n == 0:
            return CpuStored("raw", src.clone(), n, n)
        p = self.page_size
        pages = cpu_codec.page_rows(src, p)
        count = pages.shape[0]
        payload, sizes, kinds = compress_cpu_direct(pages, element_size, float_format)
        offsets = cpu_codec.packed_offsets(sizes, p)
        packed = torch.empty(int(offsets[count]), dtype=torch.uint8)
        cpu_codec.pack_into(payload, offsets, packed)
        sums = cpu_codec.page_checksums_cpu(pages) if self.checksum else None
        c = CompressedPages(packed, sizes, kinds, p, torch.from_numpy(offsets), sums,
                            "exp" if float_format else "lz4")
        per_page = 13 + 4 * (sums is not None)  # offset, size, kind (, checksum)
        return CpuStored("compressed", c, n, c.payload.numel() + count * per_page,
                         exp=bool(float_format))

    def restore(self, stored: CpuStored, out: torch.Tensor) -> None:
        """``stored``'s bytes into ``out`` (``uint8 [n]``, CPU): whole pages decoded in place
        where ``out`` holds whole pages and is contiguous, else through a decoded copy."""
        from .. import api

        if stored.kind == "raw":
            out.copy_(stored.data)
            return
        c, p = stored.data, self.page_size
        if stored.nbytes % p == 0 and out.is_contiguous():
            api.decompress(c, backend="cpu", out=out.view(-1, p))
        else:
            out.copy_(api.decompress(c, backend="cpu").view(-1)[: stored.nbytes])

    def free(self, stored: CpuStored) -> None:
        stored.data = None
        stored.freed = True


# --------------------------------------------------------------------------------- policy
class ClassPolicy:
    """Per ``(dtype, shape)`` class: compress the first tensors, measure the ratio
    (uncompressed / stored bytes) once they are done, then keep compressing only when the
    ratio reaches ``min_ratio``; otherwise the class takes the uncompressed pinned path.

    A class may have several candidate codecs (the hooks' ``codec="auto"`` for 16-bit floats:
    the exponent codec, then LZ4 + bit-shuffle). Its samples then alternate between them,
    ``samples`` each, and the class keeps the one that stored its samples smaller. On the
    stock models' activations the exponent codec won every bf16 class (1.35-1.43x against
    LZ4's 1.22-1.42x, ``bench/results/h200_971123c_percls/``); LZ4 wins where most values
    are zero (its bit planes are then nearly empty, while the exponent codec stores every
    value's sign and mantissa byte), so neither codec is right for every class.

    A stored sample reports ``kernel_bytes()``: ``(page bytes, stored bytes)`` of what went
    through the compressor, ``None`` until known; a sample with no compressed pages says
    nothing about the data, and the next tensor of the class is sampled instead."""

    def __init__(self, samples: int = 2, min_ratio: float = 1.1):
        self.samples = samples
        self.min_ratio = min_ratio
        self.decided: dict[tuple, bool] = {}  # whether the class compresses
        self.codecs: dict[tuple, str] = {}  # the codec a compressing class keeps
        self.ratios: dict[tuple, float] = {}  # the class's ratio with its best candidate
        self.codec_ratios: dict[tuple, dict[str, float]] = {}  # every candidate's
        self._candidates: dict[tuple, tuple[str, ...]] = {}
        self._pending: dict[tuple, list[tuple[str, object]]] = {}  # (codec, stored) samples
        self._measured: dict[tuple, dict[str, list[tuple[int, int]]]] = {}

    def choose(self, key: tuple, candidates: tuple[str, ...] = ("lz4",)) -> str | None:
        """The codec for the next tensor of ``key`` (one of ``candidates``, in order of
        preference on a tie), or ``None``: copy it uncompressed."""
        if key not in self.decided:
            self._candidates.setdefault(key, candidates)
            self.poll(key)
        if key in self.decided:
            return self.codecs[key] if self.decided[key] else None
        taken = self._taken(key)
        return min(self._candidates[key], key=lambda c: taken.get(c, 0))  # the first on a tie

    def compress(self, key: tuple) -> bool:
        """Whether the next tensor of ``key`` (one candidate codec) is compressed."""
        return self.choose(key) is not None

    def sample(self, key: tuple, stored, codec: str = "lz4") -> None:
        """``stored``, a tensor of ``key`` that ``codec`` compressed, is measured if the class
        still needs a sample of that codec."""
        if key not in self.decided and self._taken(key).get(codec, 0) < self.samples:
            self._pending.setdefault(key, []).append((codec, stored))

    def _taken(self, key: tuple) -> dict[str, int]:
        taken = {c: len(m) for c, m in self._measured.get(key, {}).items()}
        for codec, _ in self._pending.get(key, ()):
            taken[codec] = taken.get(codec, 0) + 1
        return taken

    def poll(self, key: tuple | None = None) -> None:
        for k in [key] if key is not None else list(self._pending):
            pending = self._pending.get(k, [])
            for item in list(pending):
                codec, s = item
                measured = s.kernel_bytes()
                if measured is None and not s.freed:
                    continue  # not placed yet: its stored size is still on the device
                if measured is not None and measured[0] > 0:
                    self._measured.setdefault(k, {}).setdefault(codec, []).append(measured)
                pending.remove(item)
            self._decide(k)

    def _decide(self, k: tuple) -> None:
        done = self._measured.get(k, {})
        candidates = self._candidates.get(k) or tuple(done) or ("lz4",)
        if k in self.decided or any(len(done.get(c, ())) < self.samples for c in candidates):
            return
        ratios = {c: sum(a for a, _ in done[c]) / max(1, sum(b for _, b in done[c]))
                  for c in candidates}
        best = max(candidates, key=lambda c: ratios[c])  # the first on a tie
        self.codec_ratios[k] = ratios
        self.codecs[k], self.ratios[k] = best, ratios[best]
        self.decided[k] = ratios[best] >= self.min_ratio
        self._pending.pop(k, None)

    def summary(self) -> dict:
        """Per decided class: its ratio, whether it compresses, its codec and every
        candidate's ratio."""
        return {
            f"{k[0]}{list(k[1])}": {"ratio": round(r, 4), "compress": self.decided[k],
                                   "codec": self.codecs[k],
                                   "ratios": {c: round(x, 4)
                                              for c, x in self.codec_ratios[k].items()}}
            for k, r in self.ratios.items()
        }
