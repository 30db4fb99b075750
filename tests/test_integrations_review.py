"""Failure paths and lifetimes of the integrations: the torchtune / TRL activation-offload
drop-ins and the transformers KV cache (CPU; transformers tests skip where it is missing)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn as nn

from tests.test_integrations import TinyDecoder, assert_identical, grads, lm_loss
from torch_pagecomp.integrations.torchtune import get_act_offloading_ctx_manager


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_a_dropped_ctx_manager_is_collected_with_its_hooks(seed):
    """The model's hooks must not keep the offloader alive: a ctx the user drops (a recipe
    that makes one per step, a second TRL trainer on the same model) is collected with what
    it holds (pinned pools, compressed stores), and its hooks leave the model. The blocks'
    ``next_group`` hooks held it, so every ctx ever made lived as long as the model and each
    one added a hook to every block."""
    model = TinyDecoder()
    loss = lm_loss(model, 2, 8)

    ref = grads(model, loss)
    refs = []
    for _ in range(3):  # a ctx made afresh every step
        ctx = get_act_offloading_ctx_manager(model, True, min_offload_size=0, offload_cpu=True)
        assert_identical(ref, grads(model, loss, ctx))
        assert ctx.stats()["offloaded_bytes"] > 0 and ctx.stats()["kept_region"] > 0
        refs.append(weakref.ref(ctx))
        del ctx
        gc.collect()
    assert all(r() is None for r in refs), "a dropped ctx manager is kept alive by the model"
    assert _hook_count(model) == 0
    assert_identical(ref, grads(model, loss))

    # a ctx the user holds keeps its hooks; remove() still takes them off
    ctx = get_act_offloading_ctx_manager(model, True, min_offload_size=0, offload_cpu=True)
    gc.collect()
    assert _hook_count(model) > 0
    assert_identical(ref, grads(model, loss, ctx))
    ctx.remove()
    assert _hook_count(model) == 0


class _Interrupt(nn.Module):
    """A head whose forward can be interrupted (Ctrl-C): torch runs ``always_call`` forward
    hooks after an ``Exception`` only, not after a ``KeyboardInterrupt``."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head, self.interrupt = head, False

    def forward(self, x):
        y = self.head(x)
        if self.interrupt:
            raise KeyboardInterrupt
        return y


@pytest.fixture
def keep_depth():
    """This thread's keep_on_gpu depth, put back after the test (a region left open would keep
    every later test's saved tensors in place)."""
    from torch_pagecomp.offload._entry import _tls

    depth = _tls.keep
    yield
    _tls.keep = depth


def head_interrupted(ctx_inside: bool):
    """``(model, loss, gradients without offload, ctx)``: a ``TinyDecoder`` under a torchtune
    ctx whose head's forward was just interrupted (Ctrl-C), inside the ctx or outside it; the
    head interrupts no more after."""
    model = TinyDecoder()
    model.output = _Interrupt(model.output)
    loss = lm_loss(model, 2, 8)
    ref = grads(model, loss)
    ctx = get_act_offloading_ctx_manager(model, True, min_offload_size=0, offload_cpu=True)
    model.output.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        with ctx if ctx_inside else contextlib.nullcontext():
            model(torch.randint(0, 50, (2, 8)))
    model.output.interrupt = False
    return model, loss, ref, ctx


@pytest.mark.parametrize("inside", [True, False], ids=["in-ctx", "outside-ctx"])
def test_an_interrupted_head_forward_does_not_stop_offloading(seed, keep_depth, inside):
    """Ctrl-C inside the head's forward skipped the hook that closes its keep_on_gpu region:
    the thread stayed inside it, and every later step offloaded nothing (every saved tensor
    kept, "region"). The next pass (and the end of the interrupted one) closes what the head's
    hooks left open."""
    from torch_pagecomp.offload._entry import _tls

    model, loss, ref, ctx = head_interrupted(ctx_inside=inside)
    if inside:  # the interrupted pass closed the region as it ended
        assert _tls.keep == 0
    before = ctx.stats()
    assert_identical(ref, grads(model, loss, ctx))
    after = ctx.stats()
    assert _tls.keep == 0
    assert after["offloaded_bytes"] > before["offloaded_bytes"]
    # only the head's forward kept tensors in place
    kept = after.get("kept_region", 0) - before.get("kept_region", 0)
    assert 0 < kept < after["packed"] - before["packed"]
    ctx.remove()


# ------------------------------------------------------------------------ transformers
def _transformers():
    return pytest.importorskip("transformers", minversion="4.57")


def _kv(gen, n, b=2, h=2, d=16):
    return torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen)


@pytest.mark.parametrize("bt", [4, 8])
def test_crop_reads_its_argument_as_the_installed_release_does(gen, bt):
    """``crop``'s argument changed meaning across releases: transformers 4.57 crops to a length
    when it is not negative (its assisted and prompt-lookup generation call
    ``crop(new_length)``), 5.17 still takes a length (deprecated), later 5.x raise. The layer
    raised on every positive value, so ``generate(prompt_lookup_num_tokens=...)`` failed with
    4.57, and ``crop(0)`` there kept everything. Now every argument does what ``DynamicCache``
    does with the installed release (``make test`` runs this at 4.57.1 and 5.17.0 too)."""
    DynamicCache = _transformers().DynamicCache
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    for arg in (17, 9, 8, 0, 30, -3, -12, -40):
        ref, ours = DynamicCache(), CompressedOffloadedCache(block_tokens=bt)
        for n in (13, 7):
            k, v = _kv(gen, n)
            ref.update(k, v, 0)
            ours.update(k, v, 0)
        try:
            ref.crop(arg)
        except Exception as e:  # the release refuses it: so does the cache, unchanged
            with pytest.raises(type(e)):
                ours.crop(arg)
            assert ours.get_seq_length() == 20
            continue
        ours.crop(arg)
        assert ours.get_seq_length() == ref.get_seq_length(), arg
        if ref.get_seq_length():
            k, v = ours.materialize(0)
            assert torch.equal(k, ref.layers[0].keys) and torch.equal(v, ref.layers[0].values)
        k, v = _kv(gen, 3)  # and it grows on from there as DynamicCache does
        rk, rv = ref.update(k, v, 0)
        ok, ov = ours.update(k, v, 0)
        assert torch.equal(ok, rk) and torch.equal(ov, rv)
        ours.close()


def test_prompt_lookup_generation_matches_dynamic_cache(seed):
    """Prompt-lookup decoding crops the cache after each rejected guess (with a length under
    transformers 4.57, which raised here): the same tokens as with ``DynamicCache``."""
    import inspect

    tr = _transformers()
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    config = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = tr.LlamaForCausalLM(config).eval()
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else (
        "past_key_values")
    ids = torch.randint(0, config.vocab_size, (1, 16))
    ids = torch.cat([ids, ids], 1)  # a repeat: the lookup finds guesses to verify

    def run(cache):
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=12, min_new_tokens=12, prompt_lookup_num_tokens=4,
                              pad_token_id=0, **{kw: cache})

    want = run(tr.DynamicCache())
    cache = CompressedOffloadedCache(block_tokens=8)
    assert torch.equal(run(cache), want)
    cache.close()


@pytest.mark.parametrize("bt", [4, 8])
def test_bad_beam_rows_are_refused_before_the_layer_changes(gen, bt):
    """``reorder_cache`` / ``batch_select_indices`` with rows outside the batch: DynamicCache's
    ``index_select`` raises at once and keeps the cache. Here the rows of sealed blocks were
    kept unchecked, and every later restore of the layer failed (an ``IndexError`` on use,
    for good). Now the call raises ``IndexError`` naming the rows, and the cache works on."""
    _transformers()
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    for n in (13, 2 * bt):  # a tail and sealed blocks; sealed blocks only
        cache = CompressedOffloadedCache(block_tokens=bt)
        k, v = _kv(gen, n)
        cache.update(k, v, 0)
        for rows in (torch.tensor([0, 2]), torch.tensor([-1, 0]), torch.tensor([[0, 1]])):
            with pytest.raises(IndexError, match="batch rows"):
                cache.reorder_cache(rows)
        with pytest.raises(IndexError):
            cache.batch_select_indices(torch.tensor([5]))
        cache.reorder_cache(torch.tensor([1, 0]))  # good rows still work
        got_k, got_v = cache.materialize(0)
        assert torch.equal(got_k, k[[1, 0]]) and torch.equal(got_v, v[[1, 0]])
        cache.close()


def test_a_refused_first_update_leaves_the_layer_unset(gen):
    """A first ``update`` that is refused (3-D keys, keys and values of different batches or
    tokens) must not fix the layer's heads and head sizes from it: the next, good update
    works, as with DynamicCache."""
    _transformers()
    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    k, v = _kv(gen, 5)
    cache = CompressedOffloadedCache(block_tokens=4)
    for bad in ((k[0], v[0]), (k, v[:1]), (k, v[:, :, :3]), (k[:, :, :, :8], v[:1])):
        with pytest.raises(ValueError, match="CompressedOffloadedCache"):
            cache.update(*bad, 0)
    got_k, got_v = cache.update(k, v, 0)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    cache.close()
