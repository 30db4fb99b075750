"""Page-locked host memory for the hooks' plain copies: blocks carved at exact sizes out of
chunks kept from step to step, whatever sizes the steps save.

A plain copy needs page-locked memory of its storage's size. Buffers pooled by exact size
(``pools.PinnedBufferPool``, the hooks' pool until session 78, now the pipeline's staging only)
serve only a storage of that same size. A training loop whose batches change shape (dynamic
padding: each batch padded to its longest sequence, as transformers' collators and torchtune
without packing do) saves other sizes every step: each step pinned new buffers and the pool's
shrink (removed since) unpinned the old ones, and pinning costs tens of milliseconds per 64
MiB (``cudaHostRegister``, 37 ms on an H200 host, ``_arena.VirtualArena.shrink``) while
unpinning waits for the whole device. On one H200 with a new length each step, plain copies
ran encoder-1024's step in 698 ms against 49 ms at one length, pinning and unpinning 45
buffers a step; GPT-2 and BERT-large 1,508 and 1,116 ms (``bench/results/h200_session78``,
``bench.dev_varlen``). Here any size is carved from the chunks already pinned, so once they
hold the longest step a step pins nothing, as the compressed store's arena (``_arena``) does.

* **Blocks**: ``round_up(n, ALIGN)`` bytes (carved and given back by ``pools._Chunk``, as
  ``pools.HostArena``'s), from the chunk whose largest free range is the smallest that holds
  them (then its first range that does): small storages fill the chunks
  already in use, and a chunk left empty stays whole for a storage as large as it (the
  feed-forward activations of encoder-1024 are one 64 MiB chunk each; taken from the chunk
  that served the last block, a step of random lengths scattered small blocks over the empty
  chunks and a later step pinned one more). A chunk is ``CHUNK_BYTES``, or a storage's size
  rounded up to a multiple of it.
* **Reuse waits for the GPU**: a freed block may still be read by a restore's copy (or written
  by its offload's, if the graph was dropped at once). Its last use (``last_use``, an event)
  is kept with its chunk while not complete, and the next block carved from that chunk has its
  copy's stream wait for it (a GPU-side wait).
* **Shrink** (once a step, at the end of a backward): a chunk that held no block in the last
  ``IDLE_STEPS`` steps is unpinned; the others stay. Blocks go to the first chunks that hold
  them, so a short step uses the same first chunks as a long one, and the last chunks are the
  long steps' alone: with lengths that change each step those come back every few steps, and
  stay pinned. A rule on the most chunk bytes in use at once in the busiest of the last
  ``SHRINK_STEPS`` steps (plus two chunks) unpinned and pinned again 0.5-0.6 chunks a step
  on BERT-large with lengths drawn from [seq / 4, seq] (``bench/results/h200_session78``),
  as the busiest of eight random lengths moved by more than two chunks; a chunk idle for
  ``SHRINK_STEPS`` steps goes whenever eight steps in a row miss the longest lengths, which
  random lengths do often (``tests/test_copy_arena.py`` saw it pin again). A step that saved
  more than every other (a first step, a gradient check) keeps its extra chunks
  ``IDLE_STEPS`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..pools import (
    ALIGN,
    HOST_PAGE,
    SHRINK_STEPS,
    HostBlock,
    HostMemory,
    _Chunk,
    byte_count,
    round_up,
)

CHUNK_BYTES = 64 << 20
IDLE_STEPS = 4 * SHRINK_STEPS  # a chunk idle this many steps is unpinned (see above)


@dataclass
class CopyBlock(HostBlock):
    """A block of a chunk (``pools.HostBlock``: ``tensor`` its ``uint8 [nbytes]`` view);
    ``last_use`` the event after the GPU's last use (set by the store)."""

    last_use: torch.cuda.Event | None = None

    @property
    def held_bytes(self) -> int:
        """The host bytes this block takes (its reserved size)."""
        return self.size


@dataclass
class _CopyChunk(_Chunk):
    """A chunk (``pools._Chunk``: its free ranges and bytes carved), the events of its
    freed blocks' last uses not done when freed, and the arena's step when it last held a
    block."""

    waits: list = field(default_factory=list)
    used_at: int = 0


class PinnedCopyArena:
    """The hooks' page-locked memory for plain copies (see the module docstring).

    ``get(n, stream)`` carves a block (pinning a chunk where none has room; None where that
    would pass ``max_bytes``) and makes ``stream`` wait for the GPU's last use of its bytes;
    ``put`` frees it. ``held_bytes`` (pinned), ``in_use_bytes`` (carved), ``misses`` /
    ``drops`` (chunks pinned / unpinned so far). Called under the offloader's lock."""

    def __init__(self, pin: bool, max_bytes: int | None = None, chunk_bytes: int = CHUNK_BYTES):
        self.pin, self.max_bytes = pin, max_bytes
        self.chunk_bytes = round_up(chunk_bytes, HOST_PAGE)
        self.chunks: list[_CopyChunk] = []
        self.held_bytes = self.in_use_bytes = 0
        self.hits = self.misses = self.drops = 0
        self._step = 0  # shrinks that found a block carved since the one before
        self._taken = False  # a block carved since the last shrink

    def get(self, nbytes: int, stream: torch.cuda.Stream | None) -> CopyBlock | None:
        nbytes = byte_count(nbytes, "PinnedCopyArena.get")
        size = round_up(max(nbytes, 1), ALIGN)
        best = None  # the chunk whose largest free range is the smallest that holds it
        for chunk in self.chunks:
            room = chunk.largest
            if room >= size and (best is None or room < best.largest):
                best = chunk
                if room == size:
                    break
        if best is not None:
            self.hits += 1
        else:
            best = self._new_chunk(size)
            if best is None:
                return None
            self.chunks.append(best)
            self.misses += 1
        return self._block(best, size, nbytes, stream)

    def _new_chunk(self, size: int) -> _CopyChunk | None:
        """A new chunk for a block of ``size`` bytes (its size rounded up to whole chunks,
        or less under ``max_bytes``); None where ``max_bytes`` has no room for one."""
        want, least = round_up(size, self.chunk_bytes), round_up(size, HOST_PAGE)
        if self.max_bytes is not None:
            room = self.max_bytes - self.held_bytes
            if room < least:
                idle = sum(c.mem.held_bytes for c in self.chunks if c.used == 0)
                if room + idle < least:
                    # none made even with every idle chunk gone: they stay (unpinned for a
                    # storage that never fits, every step unpinned them, each unpin waiting
                    # for the whole GPU, and the next blocks pinned them again)
                    return None
                self._drop_idle(least - room)  # (enough: the idle chunks hold it)
                room = self.max_bytes - self.held_bytes
            want = max(least, min(want, room // HOST_PAGE * HOST_PAGE))
        chunk = _CopyChunk(HostMemory(want, self.pin))
        self.held_bytes += chunk.mem.held_bytes
        return chunk

    def _block(self, chunk: _CopyChunk, size: int, nbytes: int, stream) -> CopyBlock:
        # the stream waits before anything is carved or counted: should a query or wait raise,
        # no block is left carved that nobody holds (its chunk then never unpinned)
        if chunk.waits:
            chunk.waits = [e for e in chunk.waits if not e.query()]
            if stream is not None:
                for event in chunk.waits:
                    stream.wait_event(event)
        at = chunk.carve(size)
        chunk.used_at = self._step
        self._taken = True
        self.in_use_bytes += size
        return CopyBlock(chunk, at, size, nbytes, chunk.mem.tensor[at:at + nbytes])

    def put(self, block: CopyBlock) -> None:
        chunk = block.chunk
        block.check_live()  # (its bytes may be another block's by now)
        event = block.last_use
        if event is not None and not event.query():  # the GPU may still read or write it
            chunk.waits.append(event)
        block.last_use = None
        block.give_back()
        self.in_use_bytes -= block.size
        chunk.used_at = self._step  # (held until now)

    def shrink(self) -> int:
        """Once a step: unpin the chunks that held no block in the last ``IDLE_STEPS``
        steps; returns the bytes unpinned. Nothing without a block carved since the last call
        (a compressed pass of ``prefer="speed"`` leaves the chunks for the next copied one)."""
        if not self._taken:
            return 0
        self._taken = False
        self._step += 1
        freed = 0
        for chunk in [c for c in self.chunks
                      if c.used == 0 and self._step - c.used_at > IDLE_STEPS]:
            freed += self._unpin(chunk)
        return freed

    def _drop_idle(self, excess: int) -> int:
        """Unpin chunks that hold no block, the last made first, until ``excess`` bytes are
        unpinned (or none is left); returns the bytes unpinned."""
        freed = 0
        for chunk in reversed(list(self.chunks)):
            if freed >= excess:
                break
            if chunk.used == 0:
                freed += self._unpin(chunk)
        return freed

    def _unpin(self, chunk: _CopyChunk) -> int:
        for event in chunk.waits:  # a restore may still read it
            event.synchronize()
        self.chunks.remove(chunk)
        chunk.mem.release()
        self.held_bytes -= chunk.mem.held_bytes
        self.drops += 1
        return chunk.mem.held_bytes

    def clear(self) -> None:
        """Unpin every chunk that holds no block (those that do stay counted)."""
        for chunk in [c for c in self.chunks if c.used == 0]:
            self._unpin(chunk)

    def stats(self) -> dict:
        return {"held_bytes": self.held_bytes, "in_use_bytes": self.in_use_bytes,
                "chunks": len(self.chunks), "hits": self.hits, "misses": self.misses,
                "drops": self.drops}
