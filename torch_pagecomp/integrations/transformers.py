"""A Hugging Face ``transformers`` KV cache whose layers live compressed in host memory.

    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    cache = CompressedOffloadedCache(config=model.config, block_tokens=256)
    out = model.generate(**inputs, max_new_tokens=200, cache=cache)
    # (``past_key_values=cache`` with releases that predate the rename to ``cache``)

Written against the layered cache API of ``transformers`` 5.x (``cache_utils.Cache`` holding one
``CacheLayerMixin`` per layer, ``DynamicLayer`` for full attention; the stock offloading is
``DynamicCache(offloading=True)``, which moves whole layers to the CPU and back each step).
Here each full-attention layer keeps:

* its **sealed blocks**: every ``block_tokens`` tokens, once all of them are in, the block's keys
  and values (flattened into one tensor, one handle) are offloaded once through
  :class:`~torch_pagecomp.PageCompressor` (LZ4 pages in host memory; bf16/fp16 through the
  bit-shuffled typed path, picked from the dtype). A block is never recompressed as the layer
  grows;
* its **tail**: the newest ``< block_tokens`` tokens, uncompressed on the device.

At ``update(layer_idx)`` the layer's blocks are restored (bit-exactly) into one buffer, joined
with the tail and the new tokens, and handed to attention; then the cache drops its hold of the
full tensors, so between uses a layer costs only its tail on the device. On CUDA the next
compressed layer is restored on a side stream while the current one computes (the compute
stream waits on an event; the host waits only for a block still being compressed); on the
CPU restores run when the layer is used.
Layers that are not full attention (sliding window, linear attention, ...) use transformers'
own layer classes, kept uncompressed on the device (like ``offload_only_non_sliding``).

Generated tokens are the same as with ``DynamicCache``: the attention sees the same values.
"""

from __future__ import annotations

import copy
import weakref

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicLayer

from ..module import OffloadHandle, PageCompressor

try:  # transformers >= 5: layer types and their kwargs from a config
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # pragma: no cover - older releases
    get_layer_types_and_kwargs = None

__all__ = ["CompressedLayer", "CompressedOffloadedCache"]


class _Block:
    """One sealed block: the keys then the values of ``block_tokens`` tokens, flattened into one
    tensor and compressed as one handle; ``batch`` rows as stored, ``rows`` the stored rows to
    read, in order (``None``: all, as stored; set by beam reorders and batch edits). A handle
    never changes once stored, so copies of a cache share it; its host storage is freed when
    the last block holding it is dropped."""

    __slots__ = ("handle", "batch", "rows")

    def __init__(self, handle: OffloadHandle, batch: int, rows: torch.Tensor | None = None):
        self.handle, self.batch, self.rows = handle, batch, rows

    @property
    def out_batch(self) -> int:
        return self.batch if self.rows is None else self.rows.numel()


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
        self._tail_k: torch.Tensor | None = None
        self._tail_v: torch.Tensor | None = None
        self._length = 0
        self._prefetched = None  # (n_blocks, buffer [nb, per block], event | None)

    # ------------------------------------------------------------------ transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype != value_states.dtype or key_states.device != value_states.device:
            raise ValueError(
                f"keys ({key_states.dtype}, {key_states.device}) and values "
                f"({value_states.dtype}, {value_states.device}) must share dtype and device"
            )
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
        bt = self.block_tokens
        past_k, past_v = self._restored()
        nb = len(self._blocks)
        parts_k = [t for t in (self._tail_k, key_states) if t is not None]
        parts_v = [t for t in (self._tail_v, value_states) if t is not None]
        keys = _join(past_k, parts_k)
        values = _join(past_v, parts_v)
        self._length = keys.shape[-2]
        # seal the blocks the new tokens filled: each is compressed once, never again
        start = nb * bt
        while self._length - start >= bt:
            self._blocks.append(self._seal(keys, values, start, start + bt))
            start += bt
        self._tail_k = keys[..., start:, :].clone() if start < self._length else None
        self._tail_v = values[..., start:, :].clone() if start < self._length else None
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def offload(self) -> None:
        """Drop this cache's hold of the full tensors (the blocks are on the host already)."""
        self.keys = self.values = None

    def prefetch(self) -> None:
        """Start restoring the sealed blocks (on CUDA, on the cache's side stream)."""
        if not self._blocks or self._prefetched is not None:
            return
        cache = self._cache()
        if self.device.type != "cuda":
            # on the CPU the blocks are restored when the layer is used (no overlap to gain);
            # ``_prefetch_cpu`` (tests) restores them here instead, with the same bookkeeping
            if cache._prefetch_cpu:
                buf = self._empty_buffer()
                self._restore_into(buf)
                self._prefetched = (len(self._blocks), buf, None)
            return
        compute = torch.cuda.current_stream(self.device)
        side = cache._side_stream(self.device)
        buf = self._empty_buffer()  # allocated on the compute stream
        side.wait_stream(compute)  # its memory may still be read by queued compute work
        with torch.cuda.stream(side):
            self._restore_into(buf)
            event = torch.cuda.Event()
            event.record(side)
        self._prefetched = (len(self._blocks), buf, event)

    def reset(self) -> None:
        self._drop_prefetch()
        self._blocks = []  # a handle's host storage goes when its last holder drops it
        self._tail_k = self._tail_v = None
        self._length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: negative)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache "
                "instead."
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._drop_prefetch()
        new_len = max(0, self._length - abs(tokens_to_remove))
        bt = self.block_tokens
        keep = new_len // bt
        if keep < len(self._blocks):  # the cut reaches into sealed blocks: unseal them
            buf = self._empty_buffer(keep, len(self._blocks))
            self._restore_into(buf, keep)
            keys, values = (_unblock(t) for t in self._split(buf))
            del self._blocks[keep:]
            if self._tail_k is not None:
                keys = torch.cat([keys, self._tail_k], dim=-2)
                values = torch.cat([values, self._tail_v], dim=-2)
            self._tail_k, self._tail_v = keys, values
        n = new_len - keep * bt
        if n == 0:
            self._tail_k = self._tail_v = None
        else:
            self._tail_k = self._tail_k[..., :n, :].clone()
            self._tail_v = self._tail_v[..., :n, :].clone()
        self._length = new_len

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            rows = torch.arange(self._batch_size()).repeat_interleave(repeats)
            self._select_rows(rows)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            rows = torch.arange(self._batch_size())[torch.as_tensor(indices).cpu()]
            self._select_rows(rows)

    # ------------------------------------------------------------------ extras
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """The layer's full keys and values, restored now (for inspection; ``(None, None)``
        before the first update)."""
        if not self.is_initialized or self._length == 0:
            return None, None
        past_k, past_v = self._restored()
        parts_k = [] if self._tail_k is None else [self._tail_k]
        parts_v = [] if self._tail_v is None else [self._tail_v]
        return _join(past_k, parts_k), _join(past_v, parts_v)

    def stats(self) -> dict:
        handles = [b.handle for b in self._blocks]
        tail = 0 if self._tail_k is None else (
            self._tail_k.numel() * self._tail_k.element_size()
            + self._tail_v.numel() * self._tail_v.element_size()
        )
        return {
            "tokens": self._length,
            "blocks": len(self._blocks),
            "tail_tokens": 0 if self._tail_k is None else self._tail_k.shape[-2],
            "compressed_bytes": sum(h.nbytes for h in handles),
            "host_bytes": sum(h.stored_nbytes for h in handles),
            "device_tail_bytes": tail,
        }

    def _copy_to(self, cache: CompressedOffloadedCache) -> CompressedLayer:
        """A copy owned by ``cache``: the same (immutable) compressed blocks, its own tail."""
        new = CompressedLayer(cache)
        new.block_tokens = self.block_tokens
        for name in ("device", "dtype", "_kdims", "_vdims"):
            if hasattr(self, name):
                setattr(new, name, getattr(self, name))
        new.is_initialized = self.is_initialized
        new._blocks = [_Block(b.handle, b.batch, b.rows) for b in self._blocks]
        new._tail_k = None if self._tail_k is None else self._tail_k.clone()
        new._tail_v = None if self._tail_v is None else self._tail_v.clone()
        new._length = self._length
        return new

    # ------------------------------------------------------------------ internals
    def _compressor(self) -> PageCompressor:
        return self._cache()._compressor_for(self.device)

    def _numel(self, batch: int) -> tuple[int, int]:
        """Elements of one block's keys and of its values at ``batch`` rows."""
        bt = self.block_tokens
        return batch * self._kdims[0] * bt * self._kdims[1], (
            batch * self._vdims[0] * bt * self._vdims[1]
        )

    def _split(self, flat: torch.Tensor, batch: int | None = None):
        """Views ``[..., B, H, bt, D]`` of the keys and the values in ``flat`` ``[..., n]``."""
        if batch is None:
            batch = self._blocks[0].out_batch if self._blocks else self._batch_size()
        nk, nv = self._numel(batch)
        bt = self.block_tokens
        k = flat[..., :nk].unflatten(-1, (batch, self._kdims[0], bt, self._kdims[1]))
        v = flat[..., nk : nk + nv].unflatten(-1, (batch, self._vdims[0], bt, self._vdims[1]))
        return k, v

    def _seal(self, keys: torch.Tensor, values: torch.Tensor, lo: int, hi: int) -> _Block:
        batch = keys.shape[0]
        flat = torch.empty(sum(self._numel(batch)), dtype=keys.dtype, device=keys.device)
        k, v = self._split(flat, batch)
        k.copy_(keys[..., lo:hi, :])
        v.copy_(values[..., lo:hi, :])
        # read in the compute stream's order; ``flat`` is kept alive until read, and nothing
        # writes it again (this layer drops it now)
        return _Block(self._compressor().offload(flat), batch)

    def _batch_size(self) -> int:
        if self._tail_k is not None:
            return self._tail_k.shape[0]
        return self._blocks[0].out_batch

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (a long tensor) in this order: the tail now, the sealed
        blocks at their next restore (their stored bytes do not change)."""
        self._drop_prefetch()
        rows = torch.as_tensor(rows).to(torch.long)
        if self._tail_k is not None:
            r = rows.to(self._tail_k.device)
            self._tail_k = self._tail_k.index_select(0, r)
            self._tail_v = self._tail_v.index_select(0, r)
        cpu_rows = rows.cpu()
        for b in self._blocks:
            b.rows = cpu_rows if b.rows is None else b.rows[cpu_rows]

    def _drop_prefetch(self) -> None:
        if self._prefetched is not None:
            event = self._prefetched[2]
            if event is not None:  # its buffer was allocated on the compute stream
                torch.cuda.current_stream(self.device).wait_event(event)
            self._prefetched = None

    def _empty_buffer(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        hi = len(self._blocks) if hi is None else hi
        per = sum(self._numel(self._blocks[lo].out_batch))
        return torch.empty((hi - lo, per), dtype=self.dtype, device=self.device)

    def _restore_into(self, buf: torch.Tensor, lo: int = 0) -> None:
        """Restore blocks ``lo, lo + 1, ...`` into the rows of ``buf`` (writes ordered on the
        current stream)."""
        pc = self._compressor()
        for i in range(buf.shape[0]):
            b = self._blocks[lo + i]
            if b.rows is None:
                pc.restore(b.handle, out=buf[i])
                continue
            stored_k, stored_v = self._split(pc.restore(b.handle, device=self.device), b.batch)
            out_k, out_v = self._split(buf[i], b.out_batch)
            rows = b.rows.to(self.device)
            out_k.copy_(stored_k.index_select(0, rows))
            out_v.copy_(stored_v.index_select(0, rows))

    def _restored(self):
        """The sealed blocks as ``[nb, B, H, bt, D]`` views of keys and values (ready on the
        current stream), or ``(None, None)``: a prefetch's if one matches, else restored now."""
        nb = len(self._blocks)
        if nb == 0:
            self._drop_prefetch()
            return None, None
        if self._prefetched is not None and self._prefetched[0] == nb:
            _, buf, event = self._prefetched
            self._prefetched = None
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            self._cache().counters["prefetched"] += 1
            return self._split(buf)
        self._drop_prefetch()
        buf = self._empty_buffer()
        self._restore_into(buf)
        self._cache().counters["restored_on_use"] += 1
        return self._split(buf)


def _unblock(blocks: torch.Tensor) -> torch.Tensor:
    """``[nb, B, H, bt, D]`` -> ``[B, H, nb * bt, D]`` (a copy)."""
    nb, b, h, bt, d = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4).reshape(b, h, nb * bt, d)


def _join(blocks: torch.Tensor | None, parts: list[torch.Tensor]) -> torch.Tensor:
    """The restored blocks ``[nb, B, H, bt, D]`` followed by ``parts`` along the token dim, in
    one new tensor (one copy of everything)."""
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
        config: the model's config (optional): picks each layer's kind from its layer types;
            full-attention layers are compressed, the others use transformers' own layers,
            uncompressed on the device. Without it every layer is compressed, created as the
            model first updates it.
        block_tokens: tokens per compressed block: a block is compressed once, when it is full;
            the newest ``< block_tokens`` tokens of every layer stay uncompressed on the device.
            Larger blocks compress better and cost fewer handles; smaller ones keep less on
            the device. At ``[B, H, D] = [1, 8, 128]`` bf16, 256 tokens are 512 KiB of keys.
        compressor: a :class:`~torch_pagecomp.PageCompressor` for the layers on its device
            (shared: :meth:`close` leaves it open). Layers on other devices (or all, without
            one) get a compressor of their device, made on first use and closed by
            :meth:`close`.
        prefetch: on CUDA, restore the next compressed layer on a side stream while the current
            one computes (True); False restores each layer when it is used.
        compressor_kwargs: settings of the compressors this cache makes (e.g. ``page_size``).
    """

    def __init__(
        self,
        config=None,
        block_tokens: int = 256,
        compressor: PageCompressor | None = None,
        prefetch: bool = True,
        **compressor_kwargs,
    ):
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self.prefetch_layers = prefetch
        self._compressors: dict[torch.device, PageCompressor] = {}
        self._owned: list[PageCompressor] = []
        if compressor is not None:
            if not isinstance(compressor, PageCompressor):
                raise TypeError(f"compressor must be a PageCompressor, got {compressor!r}")
            self._compressors[compressor.device] = compressor
        self._compressor_kwargs = compressor_kwargs
        self._streams: dict = {}
        self.counters = {"prefetched": 0, "restored_on_use": 0}
        self._prefetch_cpu = False  # tests: run the prefetch bookkeeping on the CPU too
        layers = []
        if config is not None:
            for kind, kwargs in zip(*_layer_types(config)):
                if kind == "full_attention":
                    layers.append(CompressedLayer(self))
                else:
                    layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
        self._lazy_layers = config is None
        super().__init__(layers=layers, offloading=False)

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
        if self.prefetch_layers and (key_states.device.type == "cuda" or self._prefetch_cpu):
            nxt = self._next_compressed(layer_idx)
            if nxt is not None and nxt is not layer and nxt.is_initialized:
                nxt.prefetch()  # overlaps with this layer's attention
        keys, values = layer.update(key_states, value_states, *args, **kwargs)
        layer.offload()
        return keys, values

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
        """Tokens, blocks, uncompressed and host bytes of the compressed blocks, device bytes
        of the tails, summed over the compressed layers; and how layers were restored."""
        per = [layer.stats() for layer in self.layers if isinstance(layer, CompressedLayer)]
        out = {k: sum(p[k] for p in per) for k in ("blocks", "compressed_bytes", "host_bytes",
                                                   "device_tail_bytes")}
        out["compressed_layers"] = len(per)
        out["ratio"] = out["compressed_bytes"] / max(1, out["host_bytes"])
        out.update(self.counters)
        return out

    def __deepcopy__(self, memo) -> CompressedOffloadedCache:
        """A copy (e.g. of a prompt's cache, to reuse it for several continuations): it shares
        the compressed blocks (never changed once stored) and this cache's compressors (which
        it does not close: close the original last), and has its own uncompressed tails."""
        new = type(self)(
            block_tokens=self.block_tokens, prefetch=self.prefetch_layers,
            **self._compressor_kwargs,
        )
        new._compressors = dict(self._compressors)
        new._lazy_layers = self._lazy_layers
        new._prefetch_cpu = self._prefetch_cpu
        new.layers = [
            layer._copy_to(new) if isinstance(layer, CompressedLayer)
            else copy.deepcopy(layer, memo)
            for layer in self.layers
        ]
        return new

    def close(self) -> None:
        """Free every layer's host storage; close the compressors this cache made."""
        self.reset()
        for pc in self._owned:
            pc.close()
            self._compressors = {d: c for d, c in self._compressors.items() if c is not pc}
        self._owned = []

    @property
    def compressors(self) -> dict[torch.device, PageCompressor]:
        """The compressor of each device holding compressed layers (``stats()``, ``counts``)."""
        return dict(self._compressors)

    # ------------------------------------------------------------------ internals
    def _compressor_for(self, device: torch.device) -> PageCompressor:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cuda":
            device = torch.device("cpu")
        pc = self._compressors.get(device)
        if pc is None:
            pc = self._compressors[device] = PageCompressor(device=device,
                                                            **self._compressor_kwargs)
            self._owned.append(pc)
        return pc

    def _side_stream(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def _next_compressed(self, layer_idx: int) -> CompressedLayer | None:
        n = len(self.layers)
        for step in range(1, n + 1):
            layer = self.layers[(layer_idx + step) % n]
            if isinstance(layer, CompressedLayer):
                return layer
        return None


def _layer_types(config) -> tuple[list[str], list[dict]]:
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if get_layer_types_and_kwargs is not None:
        return get_layer_types_and_kwargs(config)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return kinds, [
        {"sliding_window": config.sliding_window} if k == "sliding_attention" else {}
        for k in kinds
    ]
