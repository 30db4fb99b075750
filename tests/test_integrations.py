"""Integrations: the transformers KV cache (``CompressedOffloadedCache``) and the torchtune/TRL
drop-ins for activation offloading (``OffloadActivations``, ``get_act_offloading_ctx_manager``).

CPU: the cache compresses through the lz4 CPU path and restores synchronously; the activation
hooks offload CPU tensors (``offload_cpu=True``). Models are tiny random ones built from
configs (no download); fresh weights and inputs every run (the seed is printed). The
transformers tests skip themselves when it is not installed; torchtune is never imported
(its documented behaviour, from torchtune 0.6.1's source, is what the tests check).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_pagecomp.integrations.torchtune import (
    NoOpManager,
    OffloadActivations,
    get_act_offloading_ctx_manager,
)


def test_imports_stay_lazy():
    code = (
        "import sys, torch_pagecomp, torch_pagecomp.integrations as i\n"
        "assert 'transformers' not in sys.modules and 'torchtune' not in sys.modules\n"
        "assert 'CompressedOffloadedCache' in dir(i)\n"
        "import torch_pagecomp.integrations.torchtune\n"
        "assert 'transformers' not in sys.modules and 'torchtune' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------ transformers
def _transformers():
    # the integration needs the layered Cache API (it raises ImportError on older releases)
    return pytest.importorskip("transformers", minversion="4.57")


def test_transformers_version_check():
    """An older transformers gets an ImportError naming both versions, not a missing name
    deep inside the import; the versions the integration supports pass."""
    _transformers()
    from torch_pagecomp.integrations.transformers import check_transformers_version

    for old in ("4.56.2", "4.55.4", "4.9", "3.5.1"):
        with pytest.raises(ImportError, match=rf"transformers>=4\.57, found {old}"):
            check_transformers_version(old)
    for ok in ("4.57.0", "4.57.6", "5.0.0", "5.14.0", "5.24.0", "5.24.0.dev0", "6.0.0rc1", "10.0"):
        check_transformers_version(ok)


def test_transformers_release_under_test():
    """``make test`` runs this file twice: at the release requirements-dev.txt pins and at the
    oldest supported one (PAGECOMP_TRANSFORMERS names the release each run must import, so a
    run that silently picked up another install fails here)."""
    want = os.environ.get("PAGECOMP_TRANSFORMERS")
    if not want:
        pytest.skip("PAGECOMP_TRANSFORMERS not set (make test sets it)")
    assert _transformers().__version__ == want


def tiny_llama(dtype=torch.float32):
    tr = _transformers()
    config = tr.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )
    return tr.LlamaForCausalLM(config).to(dtype).eval(), config


def cache_kw(model) -> str:
    """The keyword ``generate`` takes a cache by: ``cache`` (transformers 5.x renamed it),
    ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else (
        "past_key_values"
    )


def generate(model, ids, cache, **kw):
    kw.setdefault("max_new_tokens", 20)
    # every row runs the full length: a random model may draw its EOS token early (seed
    # 536094807: both rows after 13 tokens), and the tests count the tokens generated
    kw.setdefault("min_new_tokens", kw["max_new_tokens"])
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, **{cache_kw(model): cache},
        **kw,
    )


def _store_kinds(cache) -> set[int]:
    """Page kinds of every stored block (``0x11``: LZ4 on bit-shuffled 2-byte elements)."""
    kinds = set()
    for layer in cache.layers:
        for b in getattr(layer, "_blocks", []):
            stored = b.held.stored
            for sl in getattr(stored, "slices", []):  # PagedStore's
                kinds.update(int(k) for k in sl.kinds)
            packed = getattr(stored, "data", None)  # the CPU codecs' (a packed container)
            if packed is not None and hasattr(packed, "kinds"):
                kinds.update(int(k) for k in packed.kinds)
    return kinds


# fp32, 2 KV heads of 16, batch 2: 512 bytes a token, so 8-token blocks are one whole page and
# 20-token blocks two pages and a partial one (its bytes travel uncompressed)
@pytest.mark.parametrize("bt", [8, 20])
@pytest.mark.parametrize("with_config", [True, False], ids=["config", "lazy"])
def test_generate_identical_to_dynamic_cache(seed, with_config, bt):
    DynamicCache = _transformers().DynamicCache

    from torch_pagecomp.integrations.transformers import CompressedLayer, CompressedOffloadedCache
    from torch_pagecomp.offload._paged import PagedStore

    model, config = tiny_llama()
    ids = torch.randint(0, config.vocab_size, (2, 22))
    ref_cache = DynamicCache(config=config)
    ref = generate(model, ids, ref_cache)
    cache = CompressedOffloadedCache(config=config if with_config else None, block_tokens=bt)
    out = generate(model, ids, cache)
    assert torch.equal(ref, out)

    tokens = ids.shape[1] + 20 - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == ref_cache.get_seq_length() == tokens
    layers = config.num_hidden_layers
    assert all(isinstance(layer, CompressedLayer) for layer in cache.layers)
    st = cache.stats()
    assert st["compressed_layers"] == layers and st["blocks"] == layers * (tokens // bt)
    assert st["sealed"] == st["blocks"]  # every block compressed once: none as layers grow
    (store,) = cache.stores.values()
    paged = isinstance(store, PagedStore)  # on the CPU without the interpreter: the lz4 path
    assert paged == (os.environ.get("TRITON_INTERPRET") == "1")
    assert st["restored_on_use"] > 0 and st["device_tail_bytes"] > 0
    if paged:
        assert store.device == torch.device("cpu")
        assert 0 < st["host_bytes"] <= store.arena.used + st["blocks"] * (bt * 512 % 4096)
    for i in range(layers):  # the round trip is bit-exact
        k, v = cache.materialize(i)
        assert torch.equal(k, ref_cache.layers[i].keys)
        assert torch.equal(v, ref_cache.layers[i].values)
        assert cache.layers[i].keys is None  # nothing held between uses but the tail
    cache.close()
    assert cache.get_seq_length() == 0 and cache.stats()["blocks"] == 0
    assert not paged or (store.arena.used == 0 and not store.arena.backed)  # unpinned


def test_sliding_window_layers_stay_transformers_own(seed):
    """A model with sliding-window layers (Gemma 2 alternates them with full attention): the
    cache has the layers transformers' own ``DynamicCache`` makes for the config, by the rules
    of the installed release, its plain full-attention layers compressed and the others
    transformers' own; generation past the window gives ``DynamicCache``'s tokens."""
    tr = _transformers()
    from transformers.cache_utils import DynamicLayer

    from torch_pagecomp.integrations.transformers import CompressedLayer, CompressedOffloadedCache

    config = tr.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=8,
    )
    model = tr.Gemma2ForCausalLM(config).eval()
    theirs = [type(layer) for layer in tr.DynamicCache(config=config).layers]
    assert DynamicLayer in theirs and any(k is not DynamicLayer for k in theirs)
    cache = CompressedOffloadedCache(config=config, block_tokens=8)
    assert len(cache.layers) == len(theirs)
    for layer, kind in zip(cache.layers, theirs):
        assert type(layer) is (CompressedLayer if kind is DynamicLayer else kind)
    ids = torch.randint(0, config.vocab_size, (2, 30))  # past the 8-token window
    ref = generate(model, ids, tr.DynamicCache(config=config), max_new_tokens=12)
    assert torch.equal(ref, generate(model, ids, cache, max_new_tokens=12))
    assert cache.stats()["blocks"] > 0  # the full-attention layers sealed blocks
    cache.close()


def test_a_model_without_full_attention_layers_warns():
    """A config whose every layer is sliding-window (Mistral with ``sliding_window`` set): the
    cache says that nothing will be compressed, instead of running as a plain DynamicCache
    without a word; with a full-attention layer it says nothing."""
    tr = _transformers()
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    def config(window):
        return tr.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                sliding_window=window)

    with pytest.warns(UserWarning, match="none of this model's 2 layers is a full-attention"):
        CompressedOffloadedCache(config=config(8)).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CompressedOffloadedCache(config=config(None)).close()


@pytest.mark.parametrize("store", ["paged", "cpu_codecs"])
@pytest.mark.parametrize("codec", ["auto", "lz4"])
def test_generate_bf16_typed_path_and_beams(seed, monkeypatch, codec, store):
    """bf16 blocks: the exponent codec by default (EXP pages of the bf16 layout, 0x13), LZ4
    bit-shuffled by 2-byte elements with ``codec="lz4"`` (0x11); RAW / FILL pages either way;
    greedy and beam tokens identical to ``DynamicCache``. ``cpu_codecs``: a CPU without the
    Triton interpreter, whose store takes the exponent codec for bf16 only where its C loops
    are SIMD (``exp_codec.FAST_BF16``)."""
    DynamicCache = _transformers().DynamicCache

    from torch_pagecomp.integrations import _kv_store
    from torch_pagecomp.integrations._kv_store import DeviceStore
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    if store == "cpu_codecs":
        monkeypatch.setattr(_kv_store, "interpreting", lambda: False)
    elif not _kv_store.interpreting():  # a CPU cache takes the paged store under the
        # interpreter only (CI); on a CUDA host the CUDA tests below run that store
        pytest.skip("the paged store of a CPU cache runs under TRITON_INTERPRET=1")

    seals = []
    seal = DeviceStore.seal

    def spy(self, src, element_size, float_format=None):
        seals.append((element_size, float_format))
        return seal(self, src, element_size, float_format)

    monkeypatch.setattr(DeviceStore, "seal", spy)
    model, config = tiny_llama(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 36))  # bf16: 16-token blocks are a page
    ref = generate(model, ids, DynamicCache(config=config), max_new_tokens=12)
    cache = CompressedOffloadedCache(config=config, block_tokens=16, codec=codec)
    assert torch.equal(ref, generate(model, ids, cache, max_new_tokens=12))
    assert seals and set(seals) == {(2, "bf16" if codec == "auto" else None)}
    from torch_pagecomp import exp_codec

    assert all(hasattr(s, "arena") == (store == "paged") for s in cache.stores.values())
    exp = codec == "auto" and (exp_codec.FAST_BF16 or store == "paged")
    coded = 0x13 if exp else 0x11
    kinds = _store_kinds(cache)
    assert kinds <= {0x00, 0x02, coded} and coded in kinds, kinds

    # beam search reorders the cache every step (sealed blocks through their row maps, one
    # gather for all of them); the prefetch bookkeeping (CUDA's, run synchronously here)
    # keeps a prefetch across reorders (it holds the blocks as stored)
    ref = generate(model, ids, DynamicCache(config=config), max_new_tokens=8, num_beams=3)
    for prefetch in (False, True):
        cache = CompressedOffloadedCache(config=config, block_tokens=16, prefetch=prefetch,
                                         codec=codec)
        assert torch.equal(ref, generate(model, ids, cache, max_new_tokens=8, num_beams=3))
        st = cache.stats()
        assert st["blocks"] > 0 and (st["prefetched"] > 0) == prefetch
        assert cache.layers[0]._rows is not None


def test_prefetch_bookkeeping_on_cpu(seed):
    """The next layer's blocks restored ahead (CUDA's path, synchronous here) are used when
    that layer comes, and the tokens stay identical."""
    DynamicCache = _transformers().DynamicCache

    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    model, config = tiny_llama()
    ids = torch.randint(0, config.vocab_size, (1, 20))
    ref = generate(model, ids, DynamicCache(config=config), max_new_tokens=14)
    cache = CompressedOffloadedCache(config=config, block_tokens=16, prefetch=True)
    assert torch.equal(ref, generate(model, ids, cache, max_new_tokens=14))
    st = cache.stats()
    # from the step after the first seal on, every layer's blocks come from a prefetch (the
    # first layer's from the last layer's update of the step before)
    assert st["prefetched"] > 0 and st["restored_on_use"] <= config.num_hidden_layers


@pytest.mark.parametrize("store", ["paged", "lz4"])
@pytest.mark.parametrize("bt", [5, 8])
def test_layer_ops_match_dynamic_cache(gen, monkeypatch, bt, store):
    """update in chunks, crop into sealed blocks, beam reorders, batch edits and copies: the
    same as ``DynamicCache`` at every step (``lz4``: a CPU without the Triton interpreter)."""
    DynamicCache = _transformers().DynamicCache

    from torch_pagecomp.integrations import _kv_store
    from torch_pagecomp.integrations.transformers import (
        CompressedOffloadedCache,
        _dynamic_crop_length,
    )

    if store == "lz4":
        monkeypatch.setattr(_kv_store, "interpreting", lambda: False)
    b, h, d, layers = 3, 2, 32, 2  # 1536 bytes a token: 8-token blocks are 3 pages
    ref = DynamicCache()
    ours = CompressedOffloadedCache(block_tokens=bt)

    def kv(n):
        return (torch.randn(b_now, h, n, d, generator=gen),
                torch.randn(b_now, h, n, d, generator=gen))

    def check():
        assert ours.get_seq_length() == ref.get_seq_length()
        for i in range(layers):
            k, v = ours.materialize(i)
            assert torch.equal(k, ref.layers[i].keys) and torch.equal(v, ref.layers[i].values)

    def update(n):
        for i in range(layers):
            k, v = kv(n)
            rk, rv = ref.update(k, v, i)
            ok, ov = ours.update(k, v, i)
            assert torch.equal(ok, rk) and torch.equal(ov, rv)
            assert ok.is_contiguous() and ov.is_contiguous()

    b_now = b
    for n in (9, 1, 1, 3, 6):  # a prompt, then single tokens and chunks across blocks
        update(n)
        check()
    assert ours.stats()["blocks"] == layers * (20 // bt)
    for cut in (-1, -6, -5):  # within the tail, into sealed blocks, to a block edge
        ref.crop(cut)
        ours.crop(cut)
        check()
    update(5)
    rows = torch.tensor([2, 0, 0])
    ref.reorder_cache(rows)
    ours.reorder_cache(rows)
    check()
    update(2 * bt)  # blocks sealed after a reorder read as stored
    ref.reorder_cache(torch.tensor([1, 2, 0]))  # composed with the earlier reorder
    ours.reorder_cache(torch.tensor([1, 2, 0]))
    check()
    ref.batch_repeat_interleave(2)
    ours.batch_repeat_interleave(2)
    b_now = 2 * b
    check()
    update(bt)  # a block stored with 6 rows next to blocks of 3
    check()
    keep = torch.tensor([True, False, True, True, False, True])
    ref.batch_select_indices(keep)
    ours.batch_select_indices(keep)
    b_now = 4
    check()
    update(3)
    check()

    twin = copy.deepcopy(ours)  # shares the sealed blocks, owns its tail
    twin.crop(-7)
    check()  # the original is untouched
    assert twin.get_seq_length() == ours.get_seq_length() - 7
    ref.crop(-7)
    for i in range(layers):
        k, v = twin.materialize(i)
        assert torch.equal(k, ref.layers[i].keys) and torch.equal(v, ref.layers[i].values)
    try:  # a positive crop: refused where the installed release refuses it (others read it
        # as a length: tests/test_integrations_review.py)
        _dynamic_crop_length(10, 2)
    except ValueError:
        with pytest.raises(ValueError, match="positive"):
            ours.crop(2)
    (st,) = ours.stores.values()
    assert st.stats()["host_used_bytes"] > 0
    ours.close()  # the twin still holds the stores and its blocks
    for i in range(layers):
        k, v = twin.materialize(i)
        assert torch.equal(k, ref.layers[i].keys) and torch.equal(v, ref.layers[i].values)
    twin.close()
    assert st.stats()["host_used_bytes"] == 0
    assert st.stats()["host_peak_held_bytes"] > 0  # a peak: what the blocks held at most
    assert ours.get_seq_length() == 0 and ours.stats()["blocks"] == 0
    with pytest.raises(ValueError, match="block_tokens"):
        CompressedOffloadedCache(block_tokens=0)
    with pytest.raises(ValueError, match="page_size"):
        CompressedOffloadedCache(page_size=3000)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_decode_step_restores_each_layer_with_one_decode(gen, monkeypatch, device):
    """However many blocks a layer holds, a decode step decodes each layer's blocks in one
    launch (``_decompress_into``) and one copy per run of adjacent host bytes."""
    _transformers()
    import torch_pagecomp.offload._decode as decoding
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU's compressed store needs the Triton interpreter")

    calls = []
    decode = decoding._decompress_into

    def counting(payload, offsets, sizes, kinds, pages, status, *rest):
        calls.append(pages.shape[0])
        decode(payload, offsets, sizes, kinds, pages, status, *rest)

    monkeypatch.setattr(decoding, "_decompress_into", counting)
    b, h, d, bt, layers = 1, 2, 32, 8, 3  # 512 bytes a token: one page a block
    per_step = {}
    for nb in (2, 7):
        cache = CompressedOffloadedCache(block_tokens=bt, prefetch=False)

        def kv(n):
            return (torch.randn(b, h, n, d, generator=gen).to(device),
                    torch.randn(b, h, n, d, generator=gen).to(device))

        for i in range(layers):  # the prompt seals nb blocks per layer
            cache.update(*kv(nb * bt + 3), i)
        if device == "cuda":
            torch.cuda.synchronize()  # every block packed: its placement read at the restore
        calls.clear()
        for i in range(layers):  # one decode step
            cache.update(*kv(1), i)
        per_step[nb] = list(calls)
        group = cache.layers[0]._group
        assert len(group) == nb and len(group.runs) < nb  # adjacent blocks: fewer copies
        cache.close()
    assert per_step == {2: [2] * layers, 7: [7] * layers}


def _small_store(device: str, page_size: int):
    """A ``PagedStore`` of small chunks and slices (several per tensor): on the GPU on side
    streams, on the CPU synchronous (the Triton interpreter's stand-ins)."""
    from torch_pagecomp.offload._paged import PagedStore

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU stand-ins need the Triton interpreter")
    streams = (None,) * 3 if device == "cpu" else tuple(torch.cuda.Stream() for _ in range(3))
    return PagedStore(torch.device(device), page_size, streams, chunk_bytes=1 << 16,
                      slice_bytes=1 << 14)


@pytest.mark.parametrize("float_format", [None, "bf16"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_restore_group_round_trip(gen, device, float_format):
    """Stored tensors of odd sizes (partial last pages, less than a page, several slices)
    restored back to back, bit-exact, into poisoned outputs: through the cached metadata,
    through the kernel fetch of slices not yet confirmed, and a group extended later; placed
    slices' metadata is read from the arena, behind their pages (the device copy let go),
    and a single tensor's restore too; with ``float_format`` the same through the exponent
    codec (EXP pages), and a group that mixes the two codecs."""
    from conftest import POISON

    from torch_pagecomp.offload._paged_group import StoredGroup

    P = 4096
    store = _small_store(device, P)

    def data(n):
        x = (torch.randn(n // 2 + 1, generator=gen) * 0.02).to(torch.bfloat16)
        return x.view(torch.uint8)[:n].clone().to(device)

    def poisoned(n):
        return torch.full((n,), POISON, dtype=torch.uint8, device=device)

    def offload(src, float_format=float_format):
        producer = torch.cuda.current_stream() if device == "cuda" else None
        return store.offload(src, 2, producer=producer, float_format=float_format)

    sizes = [3 * P, 5 * P + 123, 77, 9 * P, 2 * P + 1]  # 9 pages: three slices of 4 pages
    srcs = [data(n) for n in sizes]
    stored = [offload(s) for s in srcs]
    if device == "cpu":  # placements not confirmed yet (the exponent codec's: sent, their
        # copies not seen done): the fetch kernel reads every slice
        arena = store.arena
        if float_format is None:
            arena.confirm = lambda through=None, why="caller": None
        else:
            arena._publish = lambda: None
        out = poisoned(sum(sizes))
        store.restore_group(StoredGroup(P, stored), out)
        assert torch.equal(out, torch.cat(srcs))
        # (the store confirms as it backs chunks: the last slices were read by the fetch)
        assert stored[-1].slices[-1].base is None
        vars(arena).pop("confirm", None)  # the class's again
        vars(arena).pop("_publish", None)
        arena.confirm()
    for pick in ([0, 1, 2, 3, 4], [3, 0], [2], [4, 4]):
        out = poisoned(sum(sizes[i] for i in pick))
        store.restore_group(StoredGroup(P, [stored[i] for i in pick]), out)
        assert torch.equal(out, torch.cat([srcs[i] for i in pick]))

    group = StoredGroup(P, [stored[0], stored[3]])  # whole pages only: decoded in place
    for extra in (None, 5 * P, 3 * P + 9):
        if extra is not None:
            srcs.append(data(extra))
            stored.append(offload(srcs[-1]))
            group.append(stored[-1])
        for _ in range(2):  # the second restore reuses the cached metadata
            out = poisoned(group.nbytes)
            store.restore_group(group, out)
            want = torch.cat([srcs[0], srcs[3]] + srcs[len(sizes):])
            assert torch.equal(out, want)
    store.wait_placed()  # on a GPU the packs may still have been running: cached now
    store.restore_group(group, poisoned(group.nbytes))
    assert group.known == len(group) and len(group.runs) < sum(len(s.slices) for s in stored)
    for st in stored:
        for sl in st.slices:  # placed: the arena's copy, the slice's last bytes there
            assert sl.rel.device.type == "cpu"
            assert sl.meta.data_ptr() == store.arena._address(sl.base + sl.meta_at)
    assert all(t.device.type == "cpu" for t in group.meta)
    for src, st in zip(srcs, stored):
        out = poisoned(src.numel())
        store.restore(st, out)
        assert torch.equal(out, src)
    kinds = {int(k) for st in stored for sl in st.slices for k in sl.kinds.cpu()}
    assert (0x13 in kinds) == (float_format == "bf16") and (0x11 in kinds) != (0x13 in kinds)
    other = offload(srcs[1], None if float_format else "bf16")  # a partial last page
    mixed = StoredGroup(P, [stored[0], other, stored[3]])  # both codecs: a decode per run
    out = poisoned(mixed.nbytes)
    store.restore_group(mixed, out)
    assert torch.equal(out, torch.cat([srcs[0], srcs[1], srcs[3]]))
    store.free(other)
    group.truncate(1)
    out = poisoned(group.nbytes)
    store.restore_group(group, out)
    assert torch.equal(out, srcs[0])
    assert store.failed_restores() == 0
    for st in stored:
        store.free(st)
    assert store.arena.used == 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_restore_group_into_separate_outputs(gen, device):
    """The activation hooks' batched restore: whole-page stored tensors (several slices, one
    not placed yet on the CPU) decoded by one group restore, each into its own poisoned
    allocation, bit-exact; ragged groups and wrong output sizes are refused."""
    from conftest import POISON

    from torch_pagecomp.offload._paged_group import StoredGroup

    P = 4096
    store = _small_store(device, P)
    producer = torch.cuda.current_stream() if device == "cuda" else None
    sizes = [3 * P, 9 * P, P, 5 * P]
    srcs = [(torch.randn(n // 2, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8)
            .to(device) for n in sizes]
    stored = [store.offload(s, 2, producer=producer) for s in srcs]

    def check(pick):
        outs = [torch.full((sizes[i],), POISON, dtype=torch.uint8, device=device)
                for i in pick]
        store.restore_group(StoredGroup(P, [stored[i] for i in pick]), outs)
        for i, o in zip(pick, outs):
            assert torch.equal(o, srcs[i]), f"tensor {i}"

    if device == "cpu":  # placements not confirmed yet: the fetch kernel reads every slice
        confirm = store.arena.confirm
        store.arena.confirm = lambda through=None: None
        check([1, 0])
        store.arena.confirm = confirm
    for pick in ([0, 1, 2, 3], [3, 1], [2]):
        check(pick)
    with pytest.raises(ValueError, match="bytes"):
        store.restore_group(StoredGroup(P, stored[:2]), [torch.empty(sizes[0] + P,
                                                                     dtype=torch.uint8,
                                                                     device=device)] * 2)
    odd = store.offload(srcs[0][:P + 5].clone(), 2, producer=producer)
    with pytest.raises(ValueError, match="whole pages"):
        store.restore_group(StoredGroup(P, [odd]), [torch.empty(P + 5, dtype=torch.uint8,
                                                                 device=device)])
    assert store.failed_restores() == 0


def test_trl_style_training_on_hf_model(seed):
    """get_act_offloading_ctx_manager on a transformers model finds ``lm_head`` (TRL's use)."""
    model, config = tiny_llama()
    model.train()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    ref = grads(model, lambda: model(ids, labels=ids).loss)
    ctx = get_act_offloading_ctx_manager(model, True, offload_cpu=True, min_offload_size=0)
    got = grads(model, lambda: model(ids, labels=ids).loss, ctx)
    assert_identical(ref, got)
    st = ctx.stats()
    assert st["offloaded_bytes"] > 0 and st["kept_region"] > 0  # the head's inputs kept
    ctx.remove()


# --------------------------------------------------------------------------- torchtune
class TinyDecoder(nn.Module):
    """torchtune's layout: ``layers`` (a ModuleList) and ``output`` (the head)."""

    def __init__(self, d: int = 32, vocab: int = 50, n: int = 3, tied: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(n)
        )
        self.norm = nn.LayerNorm(d)
        self.output = Tied(self.tok) if tied else nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.output(self.norm(x))


class _Linear(nn.Module):
    def forward(self, x, w):
        return F.linear(x, w)


class Tied:
    """torchtune's ``TiedLinear``: not a Module; its ``linear`` is."""

    def __init__(self, emb: nn.Embedding):
        self.emb, self.linear = emb, _Linear()

    def __call__(self, x):
        return self.linear(x, self.emb.weight)


def grads(model: nn.Module, loss_fn, ctx=None) -> list[torch.Tensor]:
    """One training step's gradients (forward under ``ctx``, backward outside, as torchtune's
    recipes do)."""
    model.zero_grad(set_to_none=True)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = loss_fn()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_identical(ref, got) -> None:
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"gradient {i} differs (max {(a - b).abs().max().item()})"


def lm_loss(model: nn.Module, batch: int, tokens: int):
    """A next-token loss of ``model`` (a :class:`TinyDecoder`) on random tokens, as a
    function for :func:`grads`."""
    x = torch.randint(0, 50, (batch, tokens))
    labels = torch.randint(0, 50, (batch, tokens))
    return lambda: F.cross_entropy(model(x).flatten(0, 1), labels.flatten())


def test_offload_activations_signature_is_torchtunes():
    params = inspect.signature(OffloadActivations).parameters
    want = {"use_pin_memory": True, "use_streams": True, "max_fwd_stash_size": 5,
            "min_offload_size": 1024}
    assert list(params)[:4] == list(want)
    assert {k: params[k].default for k in want} == want
    sig = inspect.signature(get_act_offloading_ctx_manager).parameters
    assert list(sig)[:2] == ["model", "enable_activation_offloading"]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_fwd_stash_size should be at least 1"):
            OffloadActivations(max_fwd_stash_size=bad)


def test_argument_mapping():
    off = OffloadActivations(use_pin_memory=False, use_streams=False, max_fwd_stash_size=2,
                             min_offload_size=4096, offload_cpu=True)
    assert off.min_offload_bytes == 4096 and off.prefetch == 0 and off.prefer == "speed"
    assert off.tuner is not None and off.offload_cpu
    assert off.use_pin_memory is False and off.use_streams is False
    on = OffloadActivations()
    assert on.prefetch == 1 and on.min_offload_bytes == 1024
    # max_fwd_stash_size bounds the count of the in-flight stash; max_in_flight_bytes its bytes
    off = OffloadActivations(max_fwd_stash_size=2, max_in_flight_bytes=1 << 20)
    assert off.max_in_flight_tensors == 2 and off.max_in_flight_bytes == 1 << 20
    with pytest.raises(TypeError, match="min_offload_size"):
        OffloadActivations(min_offload_bytes=1)


@pytest.mark.parametrize("use_streams", [True, False])
def test_ctx_manager_grads_identical_and_head_kept(seed, use_streams):
    model = TinyDecoder()
    loss = lm_loss(model, 4, 16)
    ref = grads(model, loss)
    ctx = get_act_offloading_ctx_manager(model, enable_activation_offloading=True,
                                         use_streams=use_streams, min_offload_size=0,
                                         offload_cpu=True)
    assert isinstance(ctx, OffloadActivations)
    head_saved = []
    probe = model.output.register_forward_hook(
        lambda m, a, o: head_saved.append(ctx.counters["kept_region"])
    )
    for _ in range(3):  # reusable across steps
        assert_identical(ref, grads(model, loss, ctx))
    probe.remove()
    st = ctx.stats()
    assert st["offloaded_bytes"] > 0 and st["kept_param"] > 0
    assert st["kept_region"] == head_saved[-1] > 0  # only the head's forward kept tensors
    assert st["entries"] == 0 and st["host_bytes"] == 0  # all freed after backward
    ctx.remove()
    packed = st["packed"]
    assert_identical(ref, grads(model, loss))  # hooks off: nothing goes through it
    assert ctx.stats()["packed"] == packed


class _DDPLike(nn.Module):
    """The layout of DDP's and accelerate's wrappers: the model as ``.module``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model

    def forward(self, *args):
        return self.module(*args)


class _PeftLike(nn.Module):
    """A PEFT model's layout: ``peft_config``, and the model as ``.base_model``."""

    peft_config = {"default": None}

    def __init__(self, model: nn.Module):
        super().__init__()
        self.base_model = model

    def forward(self, *args):
        return self.base_model(*args)


@pytest.mark.parametrize("wrap", ["ddp", "peft", "ddp+peft"])
def test_ctx_manager_finds_the_head_inside_wrappers(seed, wrap):
    """As TRL's ``get_act_offloading_ctx_manager``: the head is found inside ``model.module``
    and a PEFT model's ``base_model`` (no warning, its inputs kept), gradients identical."""
    model = TinyDecoder()
    if "peft" in wrap:
        model = _PeftLike(model)
    if "ddp" in wrap:
        model = _DDPLike(model)
    tokens = torch.randint(0, 50, (2, 8))
    ref = grads(model, lambda: model(tokens).square().mean())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "no output head was detected" would raise
        ctx = get_act_offloading_ctx_manager(model, True, min_offload_size=0, offload_cpu=True)
    assert_identical(ref, grads(model, lambda: model(tokens).square().mean(), ctx))
    st = ctx.stats()
    assert st["offloaded_bytes"] > 0 and st["kept_region"] > 0
    ctx.remove()


def test_update_model_params_keeps_buffers(seed):
    """``OffloadActivations.update_model_params`` (TRL's name): a module's buffers saved for
    backward stay where they are, as with ``keep_tensors_of``; without it they are offloaded."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)
            self.register_buffer("scale", torch.randn(64, 64))

        def forward(self, x):
            return self.lin(x) * self.scale  # the product saves the buffer

    model = Scaled()
    x = torch.randn(64, 64)
    ref = grads(model, lambda: model(x).square().mean())
    kept = []
    for update in (False, True):
        ctx = OffloadActivations(offload_cpu=True, min_offload_size=0)
        if update:
            ctx.update_model_params(model)
        assert_identical(ref, grads(model, lambda: model(x).square().mean(), ctx))
        kept.append(ctx.stats().get("kept_param", 0))
        ctx.remove()
    assert kept[1] > kept[0]


def test_ctx_manager_disabled_no_head_tied_and_noop(seed):
    model = TinyDecoder()
    assert isinstance(get_act_offloading_ctx_manager(model, False), contextlib.nullcontext)

    class NoHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)

    with pytest.warns(UserWarning, match="no output head was detected"):
        get_act_offloading_ctx_manager(NoHead(), True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_act_offloading_ctx_manager(NoHead(), True, warn_if_no_head=False)

    tied = TinyDecoder(tied=True)
    tokens = torch.randint(0, 50, (2, 8))
    ref = grads(tied, lambda: tied(tokens).square().mean())
    ctx = get_act_offloading_ctx_manager(tied, True, min_offload_size=0, offload_cpu=True)
    assert_identical(ref, grads(tied, lambda: tied(tokens).square().mean(), ctx))
    assert ctx.stats()["kept_region"] > 0

    # NoOpManager: what is saved inside it does not reach the offloader
    lin = nn.Linear(16, 16)
    x = torch.randn(8, 16)
    off = OffloadActivations(min_offload_size=0, offload_cpu=True)
    with off:
        with NoOpManager():
            y = lin(torch.tanh(x))
    assert off.stats().get("packed", 0) == 0
    y.sum().backward()


def test_no_wrapping_prefetch_after_a_prefill(seed):
    """The last layer restores the first one ahead only while decoding: after an update of a
    block's worth of tokens or more (a prefill) the first layer is restored when the next
    forward uses it, so a prefill's peak never holds a restored layer."""
    DynamicCache = _transformers().DynamicCache

    from torch_pagecomp.integrations.transformers import CompressedLayer, CompressedOffloadedCache

    model, config = tiny_llama()
    n = config.num_hidden_layers
    calls = []
    real = CompressedLayer.prefetch

    def spy(layer):
        calls.append(layer.layer_index)
        return real(layer)

    ids = torch.randint(0, config.vocab_size, (1, 40))
    ref = generate(model, ids, DynamicCache(config=config), max_new_tokens=3)
    cache = CompressedOffloadedCache(config=config, block_tokens=16, prefetch=True)
    for i, layer in enumerate(cache.layers):
        layer.layer_index = i
    CompressedLayer.prefetch = spy
    try:
        out = generate(model, ids, cache, max_new_tokens=3)
    finally:
        CompressedLayer.prefetch = real
    assert torch.equal(ref, out)
    # the prefill initialises the layers in order (none is ahead of the one updating) and the
    # last one does not restore the first; each of the two decode steps prefetches every
    # layer, the first one from the last layer of the step (for the next step)
    assert calls == [*range(1, n), 0] * 2
    st = cache.stats()
    assert st["restored_on_use"] == 1  # layer 0, at the first decode step


def test_the_kv_cache_says_it_does_not_carry_gradients():
    """Sealed blocks live compressed in host memory, outside autograd: a grad-enabled forward
    that seals one raises, naming the fix, where it failed inside with an in-place autograd
    error (and gradients through the past keys would have been lost)."""
    model, config = tiny_llama()  # first: skips where transformers is older than the floor
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    ids = torch.randint(0, config.vocab_size, (1, 8))
    cache = CompressedOffloadedCache(config=config, block_tokens=4)
    kw = cache_kw(model)
    with pytest.raises(RuntimeError, match="gradients cannot flow through them"):
        model(ids, use_cache=True, **{kw: cache})
    cache = CompressedOffloadedCache(config=config, block_tokens=4)
    with torch.no_grad():  # as generate() runs it
        model(ids, use_cache=True, **{kw: cache})
    assert cache.get_seq_length() == 8


def test_a_forward_that_raised_leaves_the_cache_usable(seed):
    """The grad-enabled forward that raises leaves each layer as it was (it had advanced the
    layer's length with nothing stored, and the next generate with that cache crashed):
    the same cache then generates what DynamicCache does."""
    model, config = tiny_llama()
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    tr = _transformers()
    ids = torch.randint(0, config.vocab_size, (1, 8))
    cache = CompressedOffloadedCache(config=config, block_tokens=4)
    with pytest.raises(RuntimeError, match="gradients cannot flow through them"):
        model(ids, use_cache=True, **{cache_kw(model): cache})
    assert cache.get_seq_length() == 0
    want = generate(model, ids, tr.DynamicCache(config=config), max_new_tokens=6)
    assert torch.equal(generate(model, ids, cache, max_new_tokens=6), want)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_seal_interrupted_inside_the_store_leaves_it_usable(seed, monkeypatch, device):
    """An interrupt inside a seal, after the exponent encoder ran and before the placement
    read its counter (here in the arena's descriptor wait), leaves the stores usable: after
    ``reset()`` the same cache generates what DynamicCache does. (The counter kept the
    interrupted slice's bytes, and the next slice overran its payload.)"""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # (without the interpreter a CPU cache stores through lz4's C store: no arena)
        pytest.skip("the CPU's compressed store needs the Triton interpreter")
    model, config = tiny_llama(torch.bfloat16)
    model = model.to(device)
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache
    from torch_pagecomp.offload import _arena

    tr = _transformers()
    ids = torch.randint(0, config.vocab_size, (2, 40)).to(device)
    want = generate(model, ids, tr.DynamicCache(config=config), max_new_tokens=8)
    cache = CompressedOffloadedCache(config=config, block_tokens=16)
    real, calls = _arena.VirtualArena.host_desc, {"n": 0}

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(_arena.VirtualArena, "host_desc", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate(model, ids, cache, max_new_tokens=8)
    monkeypatch.setattr(_arena.VirtualArena, "host_desc", real)
    if device == "cuda":
        torch.cuda.synchronize()  # (the counter is zeroed on the compress stream)
    for store in cache.stores.values():
        assert all(s.end is None or int(s.end) == 0 for s in store._slots)
    cache.reset()
    assert torch.equal(generate(model, ids, cache, max_new_tokens=8), want)


def test_new_tokens_that_do_not_fit_a_layer_raise_by_name(gen):
    """Keys or values of another batch, head count, head size, dtype or token count than the
    layer holds raise a ValueError naming the layer's shape, and leave it unchanged (the
    joining copies broadcast a batch or head of one, and cast)."""
    _transformers()
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    cache = CompressedOffloadedCache(block_tokens=4)
    k = torch.randn(2, 2, 6, 16, generator=gen)
    v = torch.randn(2, 2, 6, 16, generator=gen)
    keys, _ = cache.update(k, v, 0)
    assert cache.get_seq_length() == 6 and torch.equal(keys, k)
    one = torch.randn(1, 2, 1, 16, generator=gen)
    bad = {
        "batch": (one, one),
        "heads": (torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)),
        "head size": (torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)),
        "dtype": (torch.randn(2, 2, 1, 16).double(), torch.randn(2, 2, 1, 16).double()),
        "tokens": (torch.randn(2, 2, 1, 16), torch.randn(2, 2, 2, 16)),
    }
    for name, (bk, bv) in bad.items():
        with pytest.raises(ValueError, match="does not fit this layer"):
            cache.update(bk, bv, 0)
        assert cache.get_seq_length() == 6, name
    k2, v2 = torch.randn(2, 2, 3, 16, generator=gen), torch.randn(2, 2, 3, 16, generator=gen)
    keys, values = cache.update(k2, v2, 0)
    assert torch.equal(keys, torch.cat([k, k2], -2)) and torch.equal(values, torch.cat([v, v2], -2))


def test_failed_decodes_are_checked_on_every_device(seed, monkeypatch):
    """Once a forward (at the first compressed layer), the failure counts of every device's
    store are read: a model spread over two GPUs had only the first layer's device checked."""
    model, config = tiny_llama()
    from torch_pagecomp.format import CorruptPageError
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    ids = torch.randint(0, config.vocab_size, (1, 8))
    cache = CompressedOffloadedCache(config=config, block_tokens=4)
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_kw(model): cache})

    class Failed:  # another device's store whose restores failed
        def check(self):
            raise CorruptPageError([], [], "1 compressed KV cache page(s) failed to decode")

        def close(self):
            pass

    monkeypatch.setitem(cache._stores.by_device, torch.device("meta"), Failed())
    with pytest.raises(CorruptPageError, match="failed to decode"), torch.no_grad():
        model(ids[:, :1], use_cache=True, **{cache_kw(model): cache})
