"""A Hugging Face ``transformers`` KV cache whose layers live compressed in host memory.

    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    cache = CompressedOffloadedCache(config=model.config, block_tokens=256)
    out = model.generate(**inputs, max_new_tokens=200, cache=cache)
    # (``past_key_values=cache`` with releases that predate the rename to ``cache``)
    cache.close()

Written against the layered cache API of ``transformers`` 4.57 and later
(``cache_utils.Cache`` holding one ``CacheLayerMixin`` per layer, ``DynamicLayer`` for full
attention; the stock offloading is ``DynamicCache(offloading=True)``, which moves whole layers
to the CPU and back each step). Here each full-attention layer keeps:

* its **sealed blocks**: every ``block_tokens`` tokens, once all of them are in, the block's keys
  and values (one tensor) are stored once in page-locked host memory by kernels, with no host
  thread and no host sync (``torch_pagecomp.offload._paged.PagedStore``: LZ4 pages, bf16/fp16
  bit-shuffled, placed in a device-side arena of pinned chunks). A block is never recompressed
  as the layer grows;
* its **tail**: the newest ``< block_tokens`` tokens, uncompressed on the device.

At ``update(layer_idx)`` all of the layer's blocks come back together with a constant number
of launches however many there are (one staging buffer, a copy-engine copy per run of adjacent
host bytes, one decode launch: ``PagedStore.restore_group``), are joined with the tail and the
new tokens and handed to attention; then the cache drops its hold of the full tensors, so
between uses a layer costs only its tail on the device. On CUDA the next compressed layer is
restored on a side stream while the current one computes (the compute stream waits on an
event; the host waits for nothing); on the CPU restores run when the layer is used.
Layers that are not full attention (sliding window, linear attention, ...) use transformers'
own layer classes, kept uncompressed on the device (like ``offload_only_non_sliding``).

Attention gets the same keys and values as from ``DynamicCache``, bit for bit and in the same
layout (contiguous ``[B, H, T, D]``, as its ``torch.cat``), so the generated tokens are the same
wherever the model's own kernels give the same logits for the same inputs (see the README).
"""

from __future__ import annotations

import copy
import math
import warnings
import weakref

import torch
import transformers
from packaging.version import Version  # a dependency of transformers

from ..format import DTYPE_FLOAT_FORMATS, dtype_element_size, valid_page_size
from ..offload._paged_group import StoredGroup
from ._kv_store import DeviceStore, Held, Stores

# the oldest release with the cache layers this module builds on (``CacheLayerMixin`` with
# ``lazy_initialization`` and ``is_initialized``); ``make test`` runs the tests at 4.57.1 and
# 5.17.0 (tests/compat/) as well as at the release requirements-dev.txt pins
MIN_TRANSFORMERS = (4, 57)


def check_transformers_version(version: str) -> None:
    """Raise ``ImportError`` naming both versions if ``version`` (a transformers release) is
    older than :data:`MIN_TRANSFORMERS`: older releases lack the cache layer classes this module
    builds on, and importing would fail on a missing name instead of saying what to install."""
    if Version(version).release[:2] < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(
            f"torch_pagecomp.integrations.transformers needs transformers>={need}, found "
            f"{version}: pip install 'transformers>={need}' (or torch-pagecomp[transformers])")


check_transformers_version(transformers.__version__)

from transformers.cache_utils import (  # noqa: E402 - after the version check
    Cache,
    DynamicCache,
    DynamicLayer,
)

CODECS = ("auto", "lz4")  # what CompressedOffloadedCache(codec=...) takes

__all__ = ["CompressedLayer", "CompressedOffloadedCache"]


class _Block:
    """One sealed block: its holder (copies of a cache share it; the stored bytes never change)
    and ``batch``, the rows it was stored with."""

    __slots__ = ("held", "batch")

    def __init__(self, held: Held, batch: int):
        self.held, self.batch = held, batch


class CompressedLayer(DynamicLayer):
    """A full-attention layer stored as compressed blocks on the host plus an uncompressed tail
    on the device. ``keys``/``values`` are set only inside the owning cache's ``update``."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, cache: CompressedOffloadedCache):
        super().__init__()
        self._cache = weakref.ref(cache)
        self.block_tokens = cache.block_tokens
        self._blocks: list[_Block] = []
        self._group = StoredGroup(cache.page_size)  # the blocks' stored tensors, in order
        # ``int64 [n_blocks, batch]`` (CPU): row r of the layer is row rows[i, r] of block i as
        # stored (beam reorders and batch edits); None while every block reads as stored
        self._rows: torch.Tensor | None = None
        self._gather = None  # (rows it was built for, device index tensor, unit elements)
        self._tail_k: torch.Tensor | None = None
        self._tail_v: torch.Tensor | None = None
        self._length = 0
        self._prefetched = None  # (n_blocks, uint8 buffer of the blocks as stored, event)

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype != value_states.dtype or key_states.device != value_states.device:
            raise ValueError(
                f"keys ({key_states.dtype}, {key_states.device}) and values "
                f"({value_states.dtype}, {value_states.device}) must share dtype and device"
            )
        # checked before the layer takes its heads and head sizes from them: a first update
        # refused after that (by ``_check_new``) left every later, good update refused
        if (key_states.dim() != 4 or value_states.dim() != 4
                or key_states.shape[0] != value_states.shape[0]
                or key_states.shape[-2] != value_states.shape[-2]):
            raise ValueError(
                f"CompressedOffloadedCache: keys {tuple(key_states.shape)} and values "
                f"{tuple(value_states.shape)} must be [batch, heads, tokens, head_dim] of the "
                "same batch and tokens")
        self.device = key_states.device
        self.dtype = key_states.dtype
        # [heads, head_dim] of keys and of values (they may differ, e.g. MLA)
        self._kdims = (key_states.shape[1], key_states.shape[-1])
        self._vdims = (value_states.shape[1], value_states.shape[-1])
        self.keys = self.values = None
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens; return the layer's full keys and values (on the device)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_new(key_states, value_states)
        blocks = self._restored()
        if blocks is None and self._tail_k is None:
            # the first tokens: contiguous, as DynamicCache's ``torch.cat`` hands them over
            keys, values = key_states.contiguous(), value_states.contiguous()
        else:
            past_k, past_v = (None, None) if blocks is None else self._split(blocks)
            keys = _join(past_k, [t for t in (self._tail_k, key_states) if t is not None])
            values = _join(past_v, [t for t in (self._tail_v, value_states) if t is not None])
        length = keys.shape[-2]
        bt = self.block_tokens
        start = len(self._blocks) * bt
        n = (length - start) // bt
        end = start + n * bt
        # the new tail is copied before the seal: the layer takes the sealed blocks last, so
        # that nothing after them can fail (a tail copy out of memory, an interrupt in the
        # seal left the new blocks beside the old tail and length: its tokens twice)
        tail_k = keys[..., end:, :].clone() if end < length else None
        tail_v = values[..., end:, :].clone() if end < length else None
        if n:  # seal the blocks the new tokens filled: each is compressed once, never again
            self._seal(keys, values, start, n)  # (raises before it changes the layer)
        # the layer changes only once its new blocks are stored: a forward that raised (a
        # seal under autograd, an interrupt) leaves it as it was, to be used again
        self._length = length
        self._tail_k, self._tail_v = tail_k, tail_v
        self.keys, self.values = keys, values
        return keys, values

    def _check_new(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New tokens must fit the layer: ``[batch, heads, tokens, head_dim]`` of its heads,
        head sizes, dtype and device, and (once it holds tokens) its batch. DynamicCache's
        ``torch.cat`` raises on most such mismatches; the copies that join the blocks here
        would broadcast a batch or head of one, or cast, and keep the result."""
        held = self._tail_k is not None or bool(self._blocks)
        batch = self._batch_size() if held else key_states.shape[0]
        for name, t, (heads, dim) in (("key_states", key_states, self._kdims),
                                      ("value_states", value_states, self._vdims)):
            if (t.dim() != 4 or t.shape[0] != batch or t.shape[1] != heads
                    or t.shape[-1] != dim or t.shape[-2] != key_states.shape[-2]
                    or t.dtype != self.dtype or t.device != self.device):
                raise ValueError(
                    f"CompressedOffloadedCache: {name} {tuple(t.shape)} {t.dtype} on {t.device} "
                    f"does not fit this layer, which holds [batch {batch}, heads {heads}, "
                    f"tokens, head_dim {dim}] {self.dtype} on {self.device} (new keys and "
                    "values need the same tokens too)")

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def offload(self) -> None:
        """Drop this cache's hold of the full tensors (the blocks are on the host already)."""
        self.keys = self.values = None

    def prefetch(self) -> None:
        """Start restoring the sealed blocks (on CUDA, on the store's side stream; on the CPU
        at once)."""
        if not self._blocks or self._prefetched is not None:
            return
        self._prefetched = (len(self._blocks), *self._store().restore(self._group))

    def reset(self) -> None:
        self._drop_prefetch()
        self._blocks = []  # a block is freed when its last holder drops it
        self._group = StoredGroup(self._group.page_size)
        self._rows = self._gather = None
        self._tail_k = self._tail_v = None
        self._length = 0
        # dropped, not zeroed, and uninitialised, as transformers 5.24's DynamicLayer.reset
        # does; older releases' reset zeroes the keys in place (None here once offloaded)
        self.keys = self.values = None
        self.is_initialized = False
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Crop as the installed release's ``DynamicLayer`` does: a negative value removes that
        many of the last tokens; a positive one (4.57: also 0) is the length to crop to in the
        releases that take one (4.57's assisted generation calls ``crop(new_length)``; 5.x
        deprecated it, later releases raise)."""
        new_len = _dynamic_crop_length(self.get_seq_length(), tokens_to_remove)
        if new_len >= self._length or not self.is_initialized:
            return
        self._drop_prefetch()
        bt = self.block_tokens
        keep = new_len // bt
        tail_k, tail_v = self._tail_k, self._tail_v
        unseal = keep < len(self._blocks)
        if unseal:  # the cut reaches into sealed blocks: unseal them
            keys, values = (_unblock(t[keep:]) for t in self._split(self._restored()))
            if tail_k is not None:
                keys = torch.cat([keys, tail_k], dim=-2)
                values = torch.cat([values, tail_v], dim=-2)
            tail_k, tail_v = keys, values
        n = new_len - keep * bt
        tail_k = tail_k[..., :n, :].clone() if n else None
        tail_v = tail_v[..., :n, :].clone() if n else None
        # the new tail made first, the layer changed after: a crop that failed on the way (out
        # of device memory, an interrupt) had dropped the blocks and kept the old tail
        if unseal:
            del self._blocks[keep:]
            self._group.truncate(keep)
            if self._rows is not None:
                self._rows = self._rows[:keep] if keep else None
        self._tail_k, self._tail_v = tail_k, tail_v
        self._length = new_len

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._select_rows(torch.arange(self._batch_size()).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._select_rows(torch.arange(self._batch_size())[torch.as_tensor(indices).cpu()])

    # ------------------------------------------------------------------ extras
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """The layer's full keys and values, restored now (for inspection; ``(None, None)``
        before the first update)."""
        if not self.is_initialized or self._length == 0:
            return None, None
        blocks = self._restored()
        past_k, past_v = (None, None) if blocks is None else self._split(blocks)
        return (_join(past_k, [] if self._tail_k is None else [self._tail_k]),
                _join(past_v, [] if self._tail_v is None else [self._tail_v]))

    def stats(self) -> dict:
        """Tokens, blocks, bytes compressed and held on the host (exact once every block is
        placed: :meth:`CompressedOffloadedCache.stats` waits for that), device tail bytes."""
        storeds = [b.held.stored for b in self._blocks]
        host = [s.host_nbytes() for s in storeds]
        tail = 0 if self._tail_k is None else (
            self._tail_k.numel() * self._tail_k.element_size()
            + self._tail_v.numel() * self._tail_v.element_size()
        )
        return {
            "tokens": self._length,
            "blocks": len(self._blocks),
            "tail_tokens": 0 if self._tail_k is None else self._tail_k.shape[-2],
            "compressed_bytes": sum(s.nbytes for s in storeds),
            "host_bytes": sum(s.nbytes if h is None else h for s, h in zip(storeds, host)),
            "device_tail_bytes": tail,
        }

    def _copy_to(self, cache: CompressedOffloadedCache) -> CompressedLayer:
        """A copy owned by ``cache``: the same (immutable) stored blocks, its own tail."""
        new = CompressedLayer(cache)
        new.block_tokens = self.block_tokens
        for name in ("device", "dtype", "_kdims", "_vdims"):
            if hasattr(self, name):
                setattr(new, name, getattr(self, name))
        new.is_initialized = self.is_initialized
        new._blocks = list(self._blocks)
        new._group = StoredGroup(self._group.page_size, self._group.storeds)
        new._rows = None if self._rows is None else self._rows.clone()
        new._tail_k = None if self._tail_k is None else self._tail_k.clone()
        new._tail_v = None if self._tail_v is None else self._tail_v.clone()
        new._length = self._length
        return new

    # ------------------------------------------------------------------ internals
    def _store(self) -> DeviceStore:
        return self._cache()._stores.get(self.device)

    def _numel(self, batch: int) -> tuple[int, int]:
        """Elements of one block's keys and of its values at ``batch`` rows."""
        bt = self.block_tokens
        return (batch * self._kdims[0] * bt * self._kdims[1],
                batch * self._vdims[0] * bt * self._vdims[1])

    def _split(self, flat: torch.Tensor, batch: int | None = None):
        """Views ``[..., B, H, bt, D]`` of the keys and the values in ``flat`` ``[..., n]``."""
        batch = self._batch_size() if batch is None else batch
        nk, nv = self._numel(batch)
        bt = self.block_tokens
        k = flat[..., :nk].unflatten(-1, (batch, self._kdims[0], bt, self._kdims[1]))
        v = flat[..., nk : nk + nv].unflatten(-1, (batch, self._vdims[0], bt, self._vdims[1]))
        return k, v

    def _seal(self, keys: torch.Tensor, values: torch.Tensor, lo: int, n: int) -> None:
        """Store the ``n`` blocks of ``keys``/``values`` from token ``lo`` (one tensor each)."""
        if torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad):
            # sealed blocks live compressed in host memory, outside autograd: a later forward
            # would read them without their history, and gradients through them would be lost
            raise RuntimeError(
                "CompressedOffloadedCache stores past keys and values compressed outside "
                "autograd, so gradients cannot flow through them: run the forward under "
                "torch.no_grad() or torch.inference_mode() (generate() does), or use "
                "DynamicCache where the cache must carry gradients")
        batch, bt, ds = keys.shape[0], self.block_tokens, self._store()
        ds.store.poll()  # placements known so far: the arena backs only what may still come
        flat = torch.empty((n, sum(self._numel(batch))), dtype=self.dtype, device=self.device)
        k, v = self._split(flat, batch)
        k.copy_(keys[..., lo : lo + n * bt, :].unflatten(2, (n, bt)).permute(2, 0, 1, 3, 4))
        v.copy_(values[..., lo : lo + n * bt, :].unflatten(2, (n, bt)).permute(2, 0, 1, 3, 4))
        raw = flat.view(torch.uint8)
        element_size = dtype_element_size(self.dtype)
        float_format = (DTYPE_FLOAT_FORMATS.get(self.dtype) if self._cache().codec == "auto"
                        else None)
        helds = []
        try:
            for i in range(n):
                helds.append(ds.seal(raw[i], element_size, float_format))
        finally:  # read on the compress stream (by the blocks stored before a failure too)
            ds.keep_until_read(flat)
        ds.release_scratch()
        rows = None if self._rows is None else (  # new blocks read as stored
            torch.cat([self._rows, torch.arange(batch).expand(n, batch)]))
        # the layer takes the blocks only once all are stored, with nothing left to fail
        # after them (on a failure, those stored are freed with ``helds``)
        for held in helds:
            self._blocks.append(_Block(held, batch))
            self._group.append(held.stored)
        if rows is not None:
            self._rows = rows
        self._cache().counters["sealed"] += n

    def _batch_size(self) -> int:
        if self._tail_k is not None:
            return self._tail_k.shape[0]
        return self._blocks[0].batch if self._rows is None else self._rows.shape[1]

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (a long tensor) in this order: the tail now, the sealed
        blocks when they are next restored (their stored bytes do not change)."""
        rows = torch.as_tensor(rows).to(torch.long)
        cpu, batch = rows.cpu(), self._batch_size()
        # checked before anything changes, as DynamicCache's index_select raises at once:
        # rows kept unchecked for the sealed blocks failed every later restore of the layer
        if cpu.dim() != 1 or (cpu.numel() and not 0 <= int(cpu.min()) <= int(cpu.max()) < batch):
            raise IndexError(f"CompressedOffloadedCache: batch rows {cpu.tolist()} are not a 1-D "
                             f"list of rows of the layer's batch of {batch}")
        if self._tail_k is not None:
            r = rows.to(self._tail_k.device)
            self._tail_k = self._tail_k.index_select(0, r)
            self._tail_v = self._tail_v.index_select(0, r)
        if self._blocks:
            self._rows = (cpu.expand(len(self._blocks), -1).clone() if self._rows is None
                          else self._rows[:, cpu])

    def _drop_prefetch(self) -> None:
        # its buffer belongs to the restore stream, which alone wrote it: dropped as it is
        self._prefetched = None

    def _restored(self) -> torch.Tensor | None:
        """The sealed blocks as ``[n_blocks, per block]`` in the layer's row order (ready on the
        current stream), or None: a prefetch's if one matches, else restored now."""
        nb = len(self._blocks)
        pf, self._prefetched = self._prefetched, None
        if pf is not None and pf[0] == nb:
            raw, event = pf[1], pf[2]
            self._cache().counters["prefetched"] += 1
        elif nb == 0:
            return None
        else:
            raw, event = self._store().restore(self._group)
            self._cache().counters["restored_on_use"] += 1
        DeviceStore.use(raw, event)
        typed = raw.view(self.dtype)
        if self._rows is None:
            return typed.view(nb, -1)
        # rows picked from every block by one gather (rows of keys and of values as units)
        idx, unit = self._gather_index()
        out = torch.empty((nb, sum(self._numel(self._rows.shape[1]))), dtype=self.dtype,
                          device=self.device)
        torch.index_select(typed.view(-1, unit), 0, idx, out=out.view(-1, unit))
        return out

    def _gather_index(self) -> tuple[torch.Tensor, int]:
        """For the current ``_rows``: the index of every output unit in the stored buffer, and
        the unit (elements; a divisor of a key row and a value row)."""
        if self._gather is not None and self._gather[0] is self._rows:
            return self._gather[1], self._gather[2]
        rows = self._rows
        batches = torch.tensor([b.batch for b in self._blocks], dtype=torch.long)
        rk, rv = self._numel(1)  # elements of one stored row of keys, of values
        unit = math.gcd(rk, rv)
        uk, uv = rk // unit, rv // unit
        per = batches * (uk + uv)
        start = torch.cumsum(per, 0) - per
        k = start[:, None, None] + rows[:, :, None] * uk + torch.arange(uk)
        v = (start + batches * uk)[:, None, None] + rows[:, :, None] * uv + torch.arange(uv)
        idx = torch.cat([k.flatten(1), v.flatten(1)], 1).flatten().to(self.device)
        self._gather = (rows, idx, unit)
        return idx, unit


def _dynamic_crop_length(length: int, tokens_to_remove: int) -> int:
    """The tokens the installed release's ``DynamicLayer.crop(tokens_to_remove)`` leaves of
    ``length`` (raising what it raises): the meaning of the argument changed across releases
    (4.57: the length to crop to when not negative; from 5.x, tokens to remove, a length
    deprecated and then refused), and generate calls it by its own release's rule. Run on a
    layer of ``meta`` tensors: no memory, no copy."""
    probe = DynamicLayer()
    probe.keys = probe.values = torch.empty((1, 1, length, 1), device="meta")
    probe.is_initialized = True
    DynamicLayer.crop(probe, tokens_to_remove)
    return probe.keys.shape[-2]


def _unblock(blocks: torch.Tensor) -> torch.Tensor:
    """``[nb, B, H, bt, D]`` -> ``[B, H, nb * bt, D]`` (a copy)."""
    nb, b, h, bt, d = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4).reshape(b, h, nb * bt, d)


def _join(blocks: torch.Tensor | None, parts: list[torch.Tensor]) -> torch.Tensor:
    """The restored blocks ``[nb, B, H, bt, D]`` followed by ``parts`` along the token dim, in
    one new contiguous tensor (one copy of everything)."""
    if blocks is None:
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=-2)
    nb, b, h, bt, d = blocks.shape
    n = nb * bt + sum(p.shape[-2] for p in parts)
    out = torch.empty((b, h, n, d), dtype=blocks.dtype, device=blocks.device)
    out[:, :, : nb * bt].unflatten(2, (nb, bt)).copy_(blocks.permute(1, 2, 0, 3, 4))
    at = nb * bt
    for p in parts:
        out[:, :, at : at + p.shape[-2]].copy_(p)
        at += p.shape[-2]
    return out


class CompressedOffloadedCache(Cache):
    """A ``transformers`` cache whose full-attention layers live compressed in host memory.

    Pass it to ``model.generate(..., cache=cache)`` (``past_key_values=cache`` in releases
    before the rename; 5.x still accepts it with a deprecation warning) or to a forward.

    Args:
        config: the model's config (optional): the cache starts with the layers transformers'
            own ``DynamicCache`` makes for it; its full-attention layers (plain
            ``DynamicLayer``) are compressed, the others (sliding window, linear attention,
            ...) stay transformers' own, uncompressed on the device. Without it every layer is
            compressed, created as the model first updates it.
        block_tokens: tokens per compressed block: a block is compressed once, when it is full;
            the newest ``< block_tokens`` tokens of every layer stay uncompressed on the device.
            Larger blocks compress as well and cost fewer stored tensors; smaller ones keep
            less on the device. At ``[B, H, D] = [1, 8, 128]`` bf16, 256 tokens are 512 KiB of
            keys. A block's bytes past its last whole page travel uncompressed.
        page_size: bytes per compressed page (a power of two, 4096..65536).
        prefetch: restore the next compressed layer ahead, while the current one computes (on
            CUDA, on a side stream). ``None`` (default): on CUDA only (on the CPU a restore
            ahead overlaps with nothing); True: on the CPU too (the same bookkeeping as on
            CUDA, restored synchronously); False: each layer is restored when it is used. The
            last layer restores the first one for the next forward only after an update of
            fewer than ``block_tokens`` tokens (decoding): during a prefill that layer would
            sit on the GPU through the forward's largest activations.
        codec: ``"auto"`` (default): bf16 / fp16 keys and values through the exponent codec
            (``compress(codec="exp-bf16")``: the exponent of each value entropy-coded per page,
            sign and mantissa as they are), other dtypes through LZ4 with a bit-shuffle by
            their element size; ``"lz4"``: LZ4 for every dtype. On a CPU without the Triton
            interpreter ``"auto"`` takes the exponent codec for bf16 where its C loops are SIMD
            (x86: as fast as LZ4 there), LZ4 for the rest.

    Host memory: page-locked chunks of 64 MiB, backed as the blocks need them (the compressed
    bytes, plus up to the uncompressed size of the blocks still being compressed); unpinned by
    :meth:`close` (or when the cache and its copies are collected).
    """

    def __init__(
        self,
        config=None,
        block_tokens: int = 256,
        page_size: int = 4096,
        prefetch: bool | None = None,
        codec: str = "auto",
    ):
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        if prefetch not in (None, True, False):
            raise ValueError(f"prefetch must be None, True or False, got {prefetch!r}")
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
        self.codec = codec
        if not isinstance(page_size, int) or not valid_page_size(page_size):
            raise ValueError(f"page_size must be a power of two from 4096 to 65536, got "
                             f"{page_size!r}")
        self.block_tokens, self.page_size = block_tokens, page_size
        self.prefetch_layers = prefetch
        self._share_stores(Stores(page_size))
        self.counters = {"prefetched": 0, "restored_on_use": 0, "sealed": 0}
        layers = []
        if config is not None:
            # the layers transformers' own cache makes for this config, by the rules of the
            # installed release (sliding, chunked, linear-attention and shared layers differ
            # from release to release); its plain full-attention layers become compressed ones
            for layer in DynamicCache(config=config).layers:
                layers.append(CompressedLayer(self) if type(layer) is DynamicLayer else layer)
            if layers and not any(isinstance(layer, CompressedLayer) for layer in layers):
                kinds = sorted({type(layer).__name__ for layer in layers})
                warnings.warn(  # no silent no-op: the cache would hold everything on the GPU
                    f"CompressedOffloadedCache: none of this model's {len(layers)} layers is a "
                    f"full-attention layer (transformers makes {', '.join(kinds)} for its "
                    "config), so nothing will be compressed or offloaded: the cache keeps every "
                    "layer on the device, as DynamicCache does", stacklevel=2)
        self._lazy_layers = config is None
        super().__init__(layers=layers, offloading=False)
        # failed decodes are checked once per forward, at the first compressed layer
        self._check_at = next(
            (i for i, layer in enumerate(self.layers) if isinstance(layer, CompressedLayer)), 0)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Append the new tokens of layer ``layer_idx``; return its full keys and values."""
        if self._lazy_layers:
            while len(self.layers) <= layer_idx:
                self.layers.append(CompressedLayer(self))
        layer = self.layers[layer_idx]
        if not isinstance(layer, CompressedLayer):
            return layer.update(key_states, value_states, *args, **kwargs)
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        ds = layer._store()
        ds.drain()
        if layer_idx == self._check_at:  # every device's store (layers spread over GPUs)
            for store in self._stores.by_device.values():
                store.check()
        if self.prefetch_layers or (self.prefetch_layers is None
                                    and key_states.device.type == "cuda"):
            nxt, wraps = self._next_compressed(layer_idx)
            # The last layer would restore the first one for the next forward. After a bulk
            # update (a prefill: a block's worth of tokens or more) that restore would be held
            # through the rest of this forward, whose activations set the GPU peak, to hide
            # one layer's restore once per prefill; the next forward restores it on use.
            bulk = wraps and key_states.shape[-2] >= self.block_tokens
            if nxt is not None and nxt is not layer and nxt.is_initialized and not bulk:
                nxt.prefetch()  # overlaps with this layer's attention
        keys, values = layer.update(key_states, value_states, *args, **kwargs)
        layer.offload()
        return keys, values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder every layer for beam search (the indices read on the host once, not per
        layer)."""
        super().reorder_cache(beam_idx.cpu())

    def offload(self, layer_idx: int, only_non_sliding: bool = True):
        layer = self.layers[layer_idx]
        if isinstance(layer, CompressedLayer):
            layer.offload()

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True):
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if isinstance(layer, CompressedLayer) and layer.is_initialized:
            layer.prefetch()

    def materialize(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s full keys and values, restored now (``[B, H, T, D]`` each)."""
        layer = self.layers[layer_idx]
        if isinstance(layer, CompressedLayer):
            return layer.materialize()
        return layer.keys, layer.values

    def stats(self) -> dict:
        """Summed over the compressed layers: blocks, their uncompressed (``compressed_bytes``)
        and stored (``host_bytes``) sizes, the device bytes of the tails; ``ratio``; how
        layers were restored and blocks sealed (``counters``); the page-locked host memory
        the stores hold now and at their peak. Waits until every block is placed."""
        for ds in self._stores.by_device.values():
            ds.drain()
            ds.store.wait_placed()
        per = [layer.stats() for layer in self.layers if isinstance(layer, CompressedLayer)]
        out = {k: sum(p[k] for p in per) for k in ("blocks", "compressed_bytes", "host_bytes",
                                                   "device_tail_bytes")}
        out["compressed_layers"] = len(per)
        out["ratio"] = out["compressed_bytes"] / max(1, out["host_bytes"])
        out.update(self.counters)
        stores = [ds.store.stats() for ds in self._stores.by_device.values()]
        out["host_held_bytes"] = sum(s["host_held_bytes"] for s in stores)
        out["host_peak_held_bytes"] = sum(s["host_peak_held_bytes"] for s in stores)
        return out

    @property
    def stores(self) -> dict:
        """The block store of each device holding compressed layers."""
        return {d: ds.store for d, ds in self._stores.by_device.items()}

    def __deepcopy__(self, memo) -> CompressedOffloadedCache:
        """A copy (e.g. of a prompt's cache, to reuse it for several continuations): it shares
        the stored blocks (never changed once stored) and the stores, and has its own
        uncompressed tails. The stores close when the last cache sharing them does."""
        new = type(self)(block_tokens=self.block_tokens, page_size=self.page_size,
                         prefetch=self.prefetch_layers, codec=self.codec)
        new._finalizer()
        new._share_stores(self._stores)
        new._lazy_layers = self._lazy_layers
        new._check_at = self._check_at
        new.layers = [
            layer._copy_to(new) if isinstance(layer, CompressedLayer)
            else copy.deepcopy(layer, memo)
            for layer in self.layers
        ]
        return new

    def close(self) -> None:
        """Drop every layer's blocks; the last cache sharing the stores frees their host
        memory. The cache can be used again afterwards (with new stores)."""
        self.reset()
        for ds in self._stores.by_device.values():
            ds.drain()
        self._finalizer()
        self._share_stores(Stores(self.page_size))

    # ------------------------------------------------------------------ internals
    def _share_stores(self, stores: Stores) -> None:
        stores.users += 1
        self._stores = stores
        self._finalizer = weakref.finalize(self, stores.release)
        self._finalizer.atexit = False  # at exit the process's memory goes anyway

    def _next_compressed(self, layer_idx: int) -> tuple[CompressedLayer | None, bool]:
        """The next compressed layer after ``layer_idx`` (wrapping around to the first), and
        whether it wraps (it is used by the next forward, not this one)."""
        n = len(self.layers)
        for step in range(1, n + 1):
            layer = self.layers[(layer_idx + step) % n]
            if isinstance(layer, CompressedLayer):
                return layer, layer_idx + step >= n
        return None, False
