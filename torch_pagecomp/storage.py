"""What one offloaded tensor holds on the host: packed compressed batches in arena blocks.

Each batch of ``n`` pages is one arena block (the *blob*)::

    [ payload: T bytes | pad to 8 | offsets int64 [n + 1] | sizes int32 [n] | kinds uint8 [n] ]

``T = sum(sizes)``: the packed payload at its exact size (a RAW page is ``P`` bytes, so
``T <= n * P`` and a blob never exceeds its input by more than ``13 n + 23`` bytes). One copy
moves a whole blob to the device for decompression.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .format import CompressedPages, PageCompError, packed_pages
from .pools import HostArena, HostBlock


@dataclass(frozen=True)
class BlobLayout:
    n_pages: int
    payload_bytes: int  # T
    offsets_at: int
    sizes_at: int
    kinds_at: int
    total: int

    @staticmethod
    def of(n_pages: int, payload_bytes: int) -> BlobLayout:
        o = -(-payload_bytes // 8) * 8
        s = o + 8 * (n_pages + 1)
        k = s + 4 * n_pages
        return BlobLayout(n_pages, payload_bytes, o, s, k, k + n_pages)

    @property
    def meta_bytes(self) -> int:
        return self.total - self.offsets_at

    def views(self, blob: torch.Tensor):
        """``uint8`` blob (host or device) -> ``(payload [T], offsets [n+1], sizes, kinds)``."""
        n = self.n_pages
        return (
            blob[: self.payload_bytes],
            blob[self.offsets_at : self.sizes_at].view(torch.int64),
            blob[self.sizes_at : self.kinds_at].view(torch.int32),
            blob[self.kinds_at : self.kinds_at + n],
        )


def meta_capacity(batch_pages: int) -> int:
    """Bytes of ``offsets + sizes + kinds`` for the largest batch (a staging buffer's size)."""
    return 8 * (batch_pages + 1) + 5 * batch_pages


def detached_error(exc: BaseException) -> BaseException:
    """A copy of ``exc`` without traceback, cause or context, to keep in a handle.

    A stored exception's traceback holds the frames it passed through, and their locals: the
    caller's ``offload`` frame holds the tensor, its contiguous copy and the handle itself,
    whose finalizer (kept alive by ``weakref.finalize``'s registry) holds the storage that
    holds the exception. So a failed offload kept all of that alive for ever. The caller still
    gets the original exception, traceback included; the handle keeps the type and message."""
    try:
        kept = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception type that cannot be copied
        kept = RuntimeError(f"{type(exc).__name__}: {exc}")
    kept.__traceback__ = kept.__cause__ = kept.__context__ = None
    return kept


@dataclass
class StoredBatch:
    block: HostBlock
    layout: BlobLayout
    first_page: int
    routed_raw: bool = False  # stored raw without the kernel (bypass or raw share)


class Storage:
    """The host side of one handle: batches, completion, readers, deferred release.

    ``check`` (the pipeline's ``check_alive``) lets :meth:`wait` give up with an error when the
    threads that would finish the batches are gone (closed, broken, or in a forked child).
    Stored errors are kept without their traceback (:func:`detached_error`).

    The submitter appends batches with :meth:`open_batch` and ends with :meth:`close`;
    ``pending`` counts batches still being written (plus 1 until closed); ``readers`` restores
    still copying blobs to the device. ``release()`` frees the blocks now when idle, else when
    the last of them finishes (so a blob being read is never recycled). Thread-safe.
    """

    direct = False  # written by the ring (``torch_pagecomp._direct``'s storages: True)

    def __init__(self, arena: HostArena, check: Callable[[], None] | None = None,
                 float_format: str | None = None):
        self.arena = arena
        # "bf16" / "fp16": the pages are the exponent codec's (``torch_pagecomp.exp_codec``),
        # which every batch's compress and decode use; None: LZ4 (bit-shuffled or not)
        self.float_format = float_format
        self._check = check  # raises when the pipeline writing this storage cannot finish it
        self._pid = os.getpid()
        self.batches: list[StoredBatch | None] = []
        self.pending = 1
        self.readers = 0
        self.error: BaseException | None = None
        self.released = False
        self._release_requested = False
        self._lock = threading.Lock()
        self.done = threading.Event()

    # ---------------------------------------------------------------- writers
    def open_batch(self) -> int:
        """Reserve the next batch's index (one more pending batch)."""
        with self._lock:
            self.batches.append(None)
            self.pending += 1
            return len(self.batches) - 1

    def close(self, error: BaseException | None = None) -> None:
        """No more batches will be opened."""
        self.batches_finished(1, error)

    def batch_stored(self, index: int, batch: StoredBatch) -> None:
        """The batch's blob is carved, its copy queued or about to be (not yet finished: even
        when the handle was freed meanwhile, the block is given back only once every batch
        finished, a failed one included)."""
        with self._lock:
            self.batches[index] = batch

    def batch_finished(self, error: BaseException | None = None) -> None:
        self.batches_finished(1, error)

    def batches_finished(self, count: int, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = detached_error(error)
            self.pending -= count
            if self.pending == 0:
                self.done.set()
                self._maybe_release()

    def ready(self) -> bool:
        """Every batch finished (never blocks)."""
        return self.done.is_set()

    def wait(self, poll: float = 0.05) -> None:
        """Block until every batch finished; raise (from ``check``) instead of waiting for ever
        when the threads that would finish them are gone."""
        while not self.done.wait(poll if self._check is not None else None):
            try:
                self._check()
            except RuntimeError:
                # the last batch may have finished after the wait timed out, its threads
                # ending after it (a close() in another thread): stored, not lost
                if not self.done.is_set():
                    raise

    # ---------------------------------------------------------------- readers
    def add_reader(self) -> None:
        with self._lock:
            if self._release_requested:
                raise RuntimeError("this handle was freed")
            self.readers += 1

    def reader_done(self) -> None:
        with self._lock:
            self.readers -= 1
            self._maybe_release()

    # ---------------------------------------------------------------- lifetime
    def release(self) -> None:
        """Free the blocks (now, or when the last writer or reader ends). A no-op in a forked
        child: its copy of the arena goes with the process, and a parent's thread may have held
        the locks at the fork."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            self._release_requested = True
            self._maybe_release()

    def _maybe_release(self) -> None:
        if self._release_requested and not self.released and self.pending == 0 and not self.readers:
            for i, b in enumerate(self.batches):
                if b is not None:
                    # unlisted before its free: a free that raises after giving the block
                    # back (an interrupt) must not have the next release give it back again
                    self.batches[i] = None
                    self.arena.free(b.block)
            self.released = True

    @property
    def codec(self) -> str:
        """``"exp"`` (the exponent codec's pages) or ``"lz4"``: which decoder reads them."""
        return "lz4" if self.float_format is None else "exp"

    @property
    def stored_nbytes(self) -> int:
        with self._lock:
            return sum(b.layout.total for b in self.batches if b is not None)

    def kernel_bytes(self, page_size: int) -> tuple[int, int]:
        """``(page bytes in, bytes stored)`` over the batches that went through the kernel:
        what the data compresses to, whatever share the pipeline stored raw."""
        with self._lock:
            done = [b for b in self.batches if b is not None and not b.routed_raw]
        return sum(b.layout.n_pages for b in done) * page_size, sum(b.layout.total for b in done)

    def compressed(self, page_size: int) -> CompressedPages:
        """All batches as one packed CPU :class:`CompressedPages` (copied out of the arena).

        Read as a restore reads them: a ``release()`` from another thread meanwhile frees the
        blocks once the copies end. Once released (its blocks given back, maybe carved again
        by a new offload) it raises: what is left would be an empty or partial container, or
        another tensor's bytes."""
        try:
            self.add_reader()
        except RuntimeError as exc:  # (freed): named as the caller's bad input, as restore does
            raise PageCompError(str(exc)) from None
        try:
            parts = [b for b in self.batches if b is not None]
            payloads, sizes, kinds = [], [], []
            for b in parts:
                payload, _, s, k = b.layout.views(b.block.tensor)
                payloads.append(payload.clone())
                sizes.append(s.clone())
                kinds.append(k.clone())
        finally:
            self.reader_done()
        return packed_pages(payloads, sizes, kinds, page_size, self.codec)
