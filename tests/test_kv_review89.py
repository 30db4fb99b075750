"""Review of the transformers KV cache's block lifetimes and failure paths (CPU; skipped where
transformers is missing). Runs on both CPU stores: the CPU codecs' and, under the Triton
interpreter (``TRITON_INTERPRET=1``, as conftest sets), the kernels' ``PagedStore``."""

from __future__ import annotations

import copy
import gc

import pytest
import torch


def _transformers():
    return pytest.importorskip("transformers", minversion="4.57")


def _kv(gen, n, b=1, h=2, d=128):
    return torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen)


def _pick_store(monkeypatch, store: str) -> None:
    from torch_pagecomp.integrations import _kv_store

    if store == "cpu_codecs":
        monkeypatch.setattr(_kv_store, "interpreting", lambda: False)
    elif not _kv_store.interpreting():
        pytest.skip("the CPU's paged store needs the Triton interpreter")


STORES = pytest.mark.parametrize("store", ["paged", "cpu_codecs"])


@STORES
def test_a_block_queued_by_the_collector_during_a_drain_is_freed(gen, monkeypatch, store):
    """A block whose last holder the cyclic collector frees while the store drains (the
    collector may run at any allocation inside a free; another thread's copy of the cache may
    drop its blocks then too) is queued by ``Held.__del__`` at the end of the sink, behind the
    block being freed. The drain popped the sink's last entry after each free, so it took
    that new block off the sink unfreed, and it held its host bytes for the life of the
    stores."""
    _transformers()
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    _pick_store(monkeypatch, store)
    cache = CompressedOffloadedCache(block_tokens=4)
    cache.update(*_kv(gen, 8), 0)  # two blocks, shared with the copy
    twin = copy.deepcopy(cache)
    twin.update(*_kv(gen, 4), 0)  # a block of the copy's own
    twin.cycle = twin  # freed by the collector only
    cache.update(*_kv(gen, 4), 0)  # a block of the original's own
    twins = [b.held.stored for b in twin.layers[0]._blocks]
    ds = cache._stores.get(torch.device("cpu"))
    store_type, real, calls = type(ds.store), type(ds.store).free, []

    def free(self, stored):
        calls.append(stored)
        if len(calls) == 1:
            gc.collect()  # the collector runs inside the first free: the copy goes
        return real(self, stored)

    gc.disable()
    try:
        del twin
        monkeypatch.setattr(store_type, "free", free)
        cache.reset()  # the original's own block to the sink
        ds.drain()
    finally:
        gc.enable()
        monkeypatch.setattr(store_type, "free", real)
    ds.drain()
    assert len(calls) >= 4 and not ds.sink
    assert all(s.freed for s in twins), "a block queued during the drain was never freed"
    assert ds.store.stats()["host_used_bytes"] == 0
    cache.close()


@STORES
@pytest.mark.parametrize("where", ["scratch", "tail"])
def test_an_update_that_fails_after_its_seal_leaves_the_layer_as_it_was(gen, monkeypatch,
                                                                         store, where):
    """An update that fills a block and fails after storing it (an interrupt in the store's
    scratch release, or the tail's copy out of memory) leaves the layer as it was, as the
    update promises. The layer took the new block before it set its length and tail: it
    kept its old tail and length beside a block holding those tokens, and the next update
    handed attention the old tail's tokens twice."""
    _transformers()
    from torch_pagecomp.integrations import _kv_store
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    _pick_store(monkeypatch, store)
    cache = CompressedOffloadedCache(block_tokens=4)
    k1, v1 = _kv(gen, 3)
    cache.update(k1, v1, 0)
    k2, v2 = _kv(gen, 2)  # fills the first block; one token left for the tail
    if where == "scratch":
        real = _kv_store.DeviceStore.release_scratch

        def fail(self):
            raise KeyboardInterrupt  # (Ctrl-C landing there)

        monkeypatch.setattr(_kv_store.DeviceStore, "release_scratch", fail)
        with pytest.raises(KeyboardInterrupt):
            cache.update(k2, v2, 0)
        monkeypatch.setattr(_kv_store.DeviceStore, "release_scratch", real)
    else:
        real = torch.Tensor.clone

        def clone(self, *args, **kwargs):
            if self.dim() == 4 and self.shape[-2] == 1:  # the new tail
                raise torch.OutOfMemoryError("out of memory (test)")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "clone", clone)
        with pytest.raises(torch.OutOfMemoryError):
            cache.update(k2, v2, 0)
        monkeypatch.setattr(torch.Tensor, "clone", real)
    assert cache.get_seq_length() == 3
    k, v = cache.materialize(0)
    assert torch.equal(k, k1) and torch.equal(v, v1)
    # the same update again, then one more token: what DynamicCache holds
    cache.update(k2, v2, 0)
    k3, v3 = _kv(gen, 1)
    k, v = cache.update(k3, v3, 0)
    assert torch.equal(k, torch.cat([k1, k2, k3], -2))
    assert torch.equal(v, torch.cat([v1, v2, v3], -2))
    assert cache.get_seq_length() == 6
    cache.close()


@STORES
def test_a_crop_that_fails_while_unsealing_leaves_the_layer_as_it_was(gen, monkeypatch, store):
    """A crop into the sealed blocks (assisted and prompt-lookup decoding's rollback) that
    fails while it joins the unsealed block with the tail (out of device memory) leaves the
    layer as it was. It dropped the blocks first: the layer kept its length over one block
    and the old tail, and the next update returned tokens that were never cropped or lost."""
    _transformers()
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    _pick_store(monkeypatch, store)
    cache = CompressedOffloadedCache(block_tokens=4)
    k1, v1 = _kv(gen, 10)  # two blocks and a tail of two
    cache.update(k1, v1, 0)
    real, calls = torch.cat, []

    def cat(tensors, *args, **kwargs):
        if tensors[0].dim() != 4:  # (the store's own, restoring)
            return real(tensors, *args, **kwargs)
        calls.append(1)  # the unsealed block joined with the tail
        raise torch.OutOfMemoryError("out of memory (test)")

    monkeypatch.setattr(torch, "cat", cat)
    with pytest.raises(torch.OutOfMemoryError):
        cache.crop(-5)  # to 5 tokens: the second block unsealed and joined with the tail
    monkeypatch.setattr(torch, "cat", real)
    assert calls and cache.get_seq_length() == 10
    k, v = cache.materialize(0)
    assert torch.equal(k, k1) and torch.equal(v, v1)
    cache.crop(-5)  # and the crop done again does what DynamicCache's does
    k2, v2 = _kv(gen, 1)
    k, v = cache.update(k2, v2, 0)
    assert torch.equal(k, torch.cat([k1[..., :5, :], k2], -2))
    assert torch.equal(v, torch.cat([v1[..., :5, :], v2], -2))
    cache.close()


@pytest.mark.parametrize("first", [True, False], ids=["first_restore", "later_restore"])
def test_a_restore_that_fails_while_caching_metadata_leaves_the_layer_readable(gen, monkeypatch,
                                                                              first):
    """A layer's restore that fails while its group caches the new blocks' page metadata (the
    page-locked buffer not allocated, an interrupt) leaves the layer readable. The group had
    counted the blocks as cached before it built their metadata: every later restore of the
    layer raised a TypeError (no metadata), or decoded with the old blocks' metadata only."""
    _transformers()
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache
    from torch_pagecomp.offload import _paged_group

    _pick_store(monkeypatch, "paged")
    cache = CompressedOffloadedCache(block_tokens=4)
    k1, v1 = _kv(gen, 8)  # two blocks of 8 KiB: two pages each
    cache.update(k1, v1, 0)
    k2, v2 = _kv(gen, 0 if first else 5)
    if not first:  # the two blocks' metadata cached by this update's restore; one more
        cache.update(k2, v2, 0)  # block, and a tail
    real, calls = _paged_group._joined, []

    def joined(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("CUDA error: out of memory (pinned, test)")

    monkeypatch.setattr(_paged_group, "_joined", joined)
    with pytest.raises(RuntimeError, match="pinned, test"):
        cache.materialize(0)
    monkeypatch.setattr(_paged_group, "_joined", real)
    assert calls
    want_k, want_v = torch.cat([k1, k2], -2), torch.cat([v1, v2], -2)
    k, v = cache.materialize(0)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    k3, v3 = _kv(gen, 1)
    k, v = cache.update(k3, v3, 0)
    assert torch.equal(k, torch.cat([want_k, k3], -2))
    assert torch.equal(v, torch.cat([want_v, v3], -2))
    cache.close()
