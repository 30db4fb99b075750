"""The last ``prefetch + 1`` groups of a forward held where they are (``offload._batch``):
read in place by the backward, stored when they leave the window, never stored when their
saved tensors are freed first, stored for a kept graph, and bounded like offloads in flight.

CPU tests run the hooks on CPU tensors (``offload_cpu=True``), where holding works as on the
GPU; the GPU test runs the compressed store on CUDA. Every run draws fresh weights and inputs.
"""

from __future__ import annotations

import os
import types
import warnings

import pytest
import torch

from tests.test_offload_batch import MLP, P, _data, _same, _step, checkpointed_step
from torch_pagecomp.offload import ActivationOffloader
from torch_pagecomp.offload._entry import _in_backward

CUDA = torch.cuda.is_available()
ROWS, WIDTH = 24, 1024  # 96 KiB a saved fp32 storage: with group_bytes below, a group each


def _model(gen, layers=4, device="cpu", dtype=torch.float32):
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    return MLP(WIDTH, layers).to(device, dtype)


def _off(**kw) -> ActivationOffloader:
    kw.setdefault("offload_cpu", True)
    kw.setdefault("min_offload_bytes", P)
    kw.setdefault("group_bytes", ROWS * WIDTH * 4)
    kw.setdefault("min_ratio", 0.0)
    kw.setdefault("sample_tensors", 1)
    return ActivationOffloader(prefer="memory", **kw)


def _waiting(off) -> int:
    return off._batcher.members


def _decided(gen):
    """``(model, x, reference gradients, offloader)`` after one offloaded step (the classes
    are decided), gradients zeroed."""
    model, x = _model(gen), _data(gen, ROWS, WIDTH)
    ref = _step(model, x)
    off = _off()
    _step(model, x, off)
    model.zero_grad(set_to_none=True)
    return model, x, ref, off


def _held_forward(gen):
    """:func:`_decided`'s, and the loss of one more forward (its last groups held)."""
    model, x, ref, off = _decided(gen)
    with off:
        loss = model(x)
    return model, x, ref, off, loss


def _link(monkeypatch, free):
    """Stand in for the GPU arena's answer to "can this batch's store start without the host
    waiting?" (``Batcher._starts_now``; on the CPU it is always yes): ``free()`` decides.
    Returns the batches asked about, in order."""
    from torch_pagecomp.offload._batch import Batcher

    asked = []

    def starts_now(self, batch):
        asked.append(batch)
        return batch.ref() is None or free()

    monkeypatch.setattr(Batcher, "_starts_now", starts_now)
    return asked


def test_the_last_groups_are_held_and_read_in_place(gen):
    model, x = _model(gen), _data(gen, ROWS, WIDTH)
    ref = _step(model, x)
    off = _off()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with off:
            loss = model(x)
        ps = off._last_pass()
        last = len(ps.groups) - 1
        held = list(off._batcher.held) + list(off._batcher.open.values())
        assert held and last > 2 and off.pending()["holding"] == sum(b.members for b in held)
        assert all(b.group[1] >= last - off.prefetch for b in held)  # the window only
        assert all(e().stored is not None for k in range(last - 1) for e in ps.groups[k]
                   if e() is not None)  # every group before it stored
        loss.backward()
        _same(ref, [p.grad for p in model.parameters()])
        assert not _waiting(off) and off.pending()["holding"] == 0
    st = off.stats()
    assert st["served_held"] > 0 and st["offloaded_bytes"] > 0, st
    assert st["restored_prefetch"] > 0 and "restored_on_demand" not in st, st
    assert st["entries"] == 0 and st["host_bytes"] == 0


def test_held_storages_whose_graph_is_dropped_are_never_stored(gen):
    model, x, ref, off, loss = _held_forward(gen)
    waiting, stored = _waiting(off), off.stats()["offloaded_bytes"]
    assert waiting > 0
    del loss  # the graph, and with it every held storage's saved tensors
    assert off.pending()["holding"] == 0  # dropped at their store
    with off:  # a new pass stores what an earlier one held: nothing is alive
        pass
    assert not _waiting(off)
    assert off.stats()["offloaded_bytes"] == stored
    assert off.pending()["entries"] == 0


def test_a_kept_graph_stores_its_held_storages_for_the_second_backward(gen):
    model, x, ref, off, loss = _held_forward(gen)
    served = off.stats().get("served_held", 0)
    stored = off.stats()["offloaded_bytes"]
    loss.backward(retain_graph=True)  # read in place, then stored at the end of backward
    _same(ref, [p.grad.clone() for p in model.parameters()])
    st = off.stats()
    assert st["served_held"] > served and st["offloaded_bytes"] > stored
    assert not _waiting(off)
    model.zero_grad(set_to_none=True)
    loss.backward()  # restored from host memory
    _same(ref, [p.grad for p in model.parameters()])
    del loss
    assert off.pending()["entries"] == 0


def test_synchronize_stores_every_held_storage(gen):
    model, x, ref, off, loss = _held_forward(gen)
    served = off.stats()["served_held"]
    assert _waiting(off)
    off.synchronize()
    assert not _waiting(off) and off.pending()["stash"] == 0
    loss.backward()
    _same(ref, [p.grad for p in model.parameters()])
    assert off.stats()["served_held"] == served  # all came back from host memory


@pytest.mark.parametrize("behind", [False, True])
@pytest.mark.parametrize("most", [1, 3])
def test_held_storages_count_against_max_in_flight_tensors(gen, most, behind, monkeypatch):
    """Held storages count against ``max_in_flight_tensors``: past it the oldest held batch is
    stored, also while the link is behind (``behind``: no due store can start without waiting;
    on a GPU that store waits for the link)."""
    model, x = _model(gen, layers=6 if behind else 4), _data(gen, ROWS, WIDTH)
    ref = _step(model, x)
    off = _off(max_in_flight_tensors=most)
    if behind:
        _link(monkeypatch, lambda: False)
    seen = []
    real = off._batcher.add

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append(_waiting(off))
        return out

    off._batcher.add = spy
    for _ in range(2):
        _same(ref, _step(model, x, off))
    assert seen and max(seen) < most, seen
    assert off.stats()["offloaded_bytes"] > 0


def test_prefetch_zero_holds_nothing(gen):
    model, x = _model(gen), _data(gen, ROWS, WIDTH)
    ref = _step(model, x)
    off = _off(prefetch=0)
    _same(ref, _step(model, x, off))
    st = off.stats()
    assert "held" not in st and "served_held" not in st and st["offloaded_bytes"] > 0


def test_one_group_held_whole_warns_once_saying_why(gen):
    model, x = _model(gen), _data(gen, ROWS, WIDTH)
    off = _off(group_bytes=None)  # one group: all of it within the window
    with pytest.warns(UserWarning, match="held in place, not stored: they are in the last"):
        _step(model, x, off)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, x, off)  # once per offloader
    assert off.stats()["offloaded_bytes"] == 0


def test_a_backward_inside_the_pass_reads_the_open_batch_in_place(gen):
    """A backward run inside the ``with`` (the pass still open): the current group's batch,
    still taking members, is read in place, and groups ended in backward are not groups."""
    model, x, ref, off = _decided(gen)
    with off:
        loss = model(x)
        assert off._batcher.open or off._batcher.held
        loss.backward()
        assert not _in_backward()
    _same(ref, [p.grad for p in model.parameters()])
    assert not _waiting(off)


def test_a_forward_that_raises_leaves_nothing_held(gen):
    """A forward that raises inside the ``with``: its held storages die with its graph, the
    next pass starts clean and runs with identical gradients."""
    import gc

    model, x, ref, off = _decided(gen)
    with pytest.raises(RuntimeError, match="boom"), off:
        model(x)  # saves, and holds its last groups
        raise RuntimeError("boom")
    gc.collect()  # the traceback's frames held the graph
    assert off.pending()["holding"] == 0
    _same(ref, _step(model, x, off))
    assert off.pending()["entries"] == 0 and off.pending()["holding"] == 0


@pytest.mark.parametrize("behind", [False, True])
def test_held_groups_under_activation_checkpointing(gen, behind, monkeypatch):
    """Non-reentrant checkpointing saves each block's input under the hooks; the last two
    blocks' inputs are held and read in place, the others stored and restored, and a
    checkpoint's recompute inside the backward saves nothing that outlives it. ``behind``:
    the link behind at four of every six asks (due stores stay held, then go), with the
    recomputes saving in the backward, where nothing is stored."""
    model, x = _model(gen, layers=6), _data(gen, ROWS, WIDTH)
    ref = checkpointed_step(model, x, torch.enable_grad())
    off = _off()
    asked = []
    if behind:
        asked = _link(monkeypatch, lambda: len(asked) % 6 > 3)
    for _ in range(3):
        _same(ref, checkpointed_step(model, x, off))
    st = off.stats()
    assert st["served_held"] > 0 and st["offloaded_bytes"] > 0, st
    assert off.pending()["entries"] == 0 and off.pending()["holding"] == 0
    assert (st.get("deferred", 0) > 0) is behind, st


def test_stores_the_link_cannot_take_stay_held_and_are_read_in_place(gen, monkeypatch):
    """The link behind all forward (no due store can start without waiting): nothing is
    stored, every group stays held and the backward reads all of it in place, with the same
    gradients; once the link keeps up the next step stores as before."""
    model, x, ref, off = _decided(gen)
    st = off.stats()
    stored, held, served = st["offloaded_bytes"], st["held"], st.get("served_held", 0)
    asked = _link(monkeypatch, lambda: False)
    with pytest.warns(UserWarning, match="because the link was still busy"), off:
        loss = model(x)
    ps = off._last_pass()
    assert len(ps.groups) > off.prefetch + 2 and asked
    assert all(e().stored is None for g in ps.groups for e in g if e() is not None)
    st = off.stats()
    assert st["offloaded_bytes"] == stored and st["deferred"] > 0, st
    assert off.pending()["holding"] == st["held"] - held  # all this pass's storages
    loss.backward()
    _same(ref, [p.grad for p in model.parameters()])
    after = off.stats()
    assert after["served_held"] - served >= after["held"] - held > after["deferred"], after
    for key in ("restored_prefetch", "restored_on_demand"):  # nothing came over the link
        assert after.get(key, 0) == st.get(key, 0), (key, st, after)
    assert not _waiting(off) and off.pending()["entries"] == 0
    monkeypatch.undo()
    model.zero_grad(set_to_none=True)
    _same(ref, _step(model, x, off))
    assert off.stats()["offloaded_bytes"] > stored


def test_deferred_stores_start_in_order_once_the_link_catches_up(gen, monkeypatch):
    """The link behind for a while: the due batches wait, oldest first, and are stored, in
    their order, at later saved storages once their stores can start; at the end of the
    forward everything outside the window is stored."""
    model, x = _model(gen, layers=6), _data(gen, ROWS, WIDTH)
    ref = _step(model, x)
    off = _off()
    _same(ref, _step(model, x, off))
    model.zero_grad(set_to_none=True)
    answers = iter([False] * 3)
    asked = _link(monkeypatch, lambda: next(answers, True))
    order = []
    real = off._store

    def store(entry, *a, **kw):
        order.append(entry.group)
        return real(entry, *a, **kw)

    off._store = store
    with off:
        loss = model(x)
    ps = off._last_pass()
    last = len(ps.groups) - 1
    assert len(asked) > 3 and order == sorted(order) and order, order
    assert all(e().stored is not None for k in range(last - off.prefetch) for e in ps.groups[k]
               if e() is not None)  # all stored by now but the window
    assert off.stats()["deferred"] > 0
    loss.backward()
    _same(ref, [p.grad for p in model.parameters()])


def test_a_bound_that_stores_a_due_batch_during_the_due_stores(gen, monkeypatch):
    """The link catches up with several batches due at once, and each store passes the
    in-flight bound, which stores the oldest held batch (on a GPU, ``_track`` bounds every
    store by its GPU bytes; here the bound always finds them over): a batch
    :meth:`Batcher.store_due` was about to store is stored by the bound first. Each is stored
    once and nothing fails. (Before, the due stores' loop stored it again: ``ValueError: ...
    not in deque``, the saved tensor at hand kept in place, on an H200 in
    ``bench/results/h200_7683f39_session44``.)"""
    model, x = _model(gen, layers=8), _data(gen, ROWS, WIDTH)
    ref = _step(model, x)
    off = _off()
    _same(ref, _step(model, x, off))
    model.zero_grad(set_to_none=True)
    answers = iter([False] * int(torch.randint(2, 7, (1,), generator=gen)))
    _link(monkeypatch, lambda: next(answers, True))
    real_track, stored = off._track, []

    def track(entry, src):
        stored.append(id(entry))
        real_track(entry, src)
        if not off._bounding and off._batcher.held:  # as _bound past max_in_flight_bytes
            off._bounding = True
            try:
                off._batcher.flush_oldest()
            finally:
                off._bounding = False

    off._track = track
    _same(ref, _step(model, x, off))
    st = off.stats()
    assert st["deferred"] > 0 and st.get("offload_failed", 0) == 0, st
    assert off._last_error is None, off._last_error
    assert len(stored) == len(set(stored)) > 2
    assert not _waiting(off) and off.pending()["entries"] == 0


def _memory(monkeypatch, over):
    """Stand in for the caching allocator's counters (``_batch.gpu_memory``), on the CPU too:
    ``over(batcher)`` is what the allocation with its room for two groups exceeds the peak by
    at each ask (at most zero: below the peak). Returns the answers given, in order."""
    from torch_pagecomp.offload import _batch

    answers = []
    real = _batch.Batcher._over_peak

    def memory(dev):
        peak = 1 << 40
        return peak + over(answers) - 2 * batcher[0].last_group_bytes, peak

    batcher = []

    def over_peak(self, dev):
        batcher[:] = [self]
        answers.append(real(self, dev))
        return answers[-1]

    monkeypatch.setattr(_batch, "gpu_memory", memory)
    monkeypatch.setattr(_batch.Batcher, "_over_peak", over_peak)
    return answers


@pytest.mark.peak_rule
def test_storages_below_the_gpu_peak_stay_held_and_are_read_in_place(gen, monkeypatch):
    """The allocation below the peak it reached (with room for two groups like the last):
    no due batch is stored, every storage of the pass stays where it is and the backward
    reads it in place, with the same gradients and nothing over the link either way; the
    warning says why. Once the allocation is over the line, the next step stores again."""
    model, x, ref, off = _decided(gen)
    st = off.stats()
    stored, held, served = st["offloaded_bytes"], st["held"], st.get("served_held", 0)
    answers = _memory(monkeypatch, lambda asked: -1)
    with pytest.warns(UserWarning, match="below the peak it had already reached"), off:
        loss = model(x)
    ps = off._last_pass()
    assert len(ps.groups) > off.prefetch + 2 and answers and max(answers) <= 0, answers
    assert all(e().stored is None for g in ps.groups for e in g if e() is not None)
    st = off.stats()
    assert st["offloaded_bytes"] == stored and st["held_below_peak"] > 0, st
    assert st.get("deferred", 0) == 0 and off.pending()["holding"] == st["held"] - held
    loss.backward()
    _same(ref, [p.grad for p in model.parameters()])
    after = off.stats()
    assert after["served_held"] - served >= after["held"] - held, after  # (some twice)
    for key in ("restored_prefetch", "restored_on_demand"):
        assert after.get(key, 0) == st.get(key, 0), (key, st, after)
    assert not _waiting(off) and off.pending()["entries"] == 0
    _memory(monkeypatch, lambda asked: 1 << 30)  # far over the peak: stored as before
    model.zero_grad(set_to_none=True)
    _same(ref, _step(model, x, off))
    assert off.stats()["offloaded_bytes"] > stored


@pytest.mark.peak_rule
def test_over_the_gpu_peak_the_oldest_due_batches_that_cover_the_excess_are_stored(
        gen, monkeypatch):
    """The allocation below the line at every other group end, over it at the others: below
    it nothing due is stored; over it by one byte, the oldest due batch is stored (freed
    once its store reads it) and the due ones after it stay held; over it by a batch's bytes
    and one, its two oldest. Stores keep the groups' order, and the gradients are the same."""
    from torch_pagecomp.offload._batch import Batcher

    model, x = _model(gen, layers=8), _data(gen, ROWS, WIDTH)
    ref = _step(model, x)
    off = _off()
    _same(ref, _step(model, x, off))
    batch_bytes = ROWS * WIDTH * 4  # a storage a batch: group_bytes closes each group
    real_due, real_flush = Batcher.store_due, Batcher.flush
    for excess, most in ((1, 1), (batch_bytes + 1, 2)):
        model.zero_grad(set_to_none=True)
        answers = _memory(monkeypatch, lambda asked, e=excess: e if len(asked) % 2 else -1)
        calls, order = [], []  # per store_due call: (its answer or None, batches it stored)

        def store_due(self, answers=answers, calls=calls):
            asked = len(answers)
            calls.append([None, 0])
            real_due(self)
            if len(answers) > asked:
                calls[-1][0] = answers[-1]

        def flush(self, batch, calls=calls, order=order):
            if calls:
                calls[-1][1] += 1
            order.append(batch.group[1])
            real_flush(self, batch)

        monkeypatch.setattr(Batcher, "store_due", store_due)
        monkeypatch.setattr(Batcher, "flush", flush)
        with off:
            loss = model(x)
        monkeypatch.setattr(Batcher, "store_due", real_due)
        monkeypatch.setattr(Batcher, "flush", real_flush)
        below = [n for a, n in calls if a is not None and a <= 0]
        over = [n for a, n in calls if a is not None and a > 0]
        assert below and over and not any(below), calls
        assert max(over) == most and min(over) >= 1, (excess, calls)
        assert order == sorted(order) and off.stats()["held_below_peak"] > 0, order
        loss.backward()
        _same(ref, [p.grad for p in model.parameters()])


def test_gpu_memory_reads_the_allocators_counters():
    """``_batch.gpu_memory``: None off a GPU; on one, the caching allocator's bytes allocated
    now and its peak since the last reset, as ``torch.cuda`` reports them."""
    from torch_pagecomp.offload._batch import gpu_memory

    assert gpu_memory(torch.device("cpu")) is None
    if not CUDA:
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats()
    t = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
    del t
    now, peak = gpu_memory(dev)
    assert now == torch.cuda.memory_allocated(dev), now
    assert peak == torch.cuda.max_memory_allocated(dev) >= now + (32 << 20), (now, peak)
    assert gpu_memory(torch.device("cuda")) == (now, peak)


def _gpu_model(gen, mode: str = "compressed"):
    """``(model, x, reference gradients, offloader)``: a six-layer bf16 MLP on CUDA (TF32
    off) and an offloader of ``mode`` that holds a group per saved storage."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(gen, layers=6, device="cuda", dtype=torch.bfloat16)
    x = _data(gen, 512, WIDTH, "cuda", torch.bfloat16)
    ref = _step(model, x)
    off = ActivationOffloader(mode=mode, prefer="memory", min_offload_bytes=P,
                              group_bytes=512 * WIDTH * 2, min_ratio=0.0, sample_tensors=1)
    return model, x, ref, off


@pytest.mark.peak_rule
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["compressed", "uncompressed"])
def test_gpu_a_pass_below_an_earlier_peak_is_read_in_place(gen, mode):
    """The caching allocator's real counters: after a larger allocation (freed) the next
    pass stays below that peak, so its storages are held and read in place (nothing stored,
    restored or sent over the link) with identical gradients; with the peak reset to what is
    allocated, the next pass stores again."""
    model, x, ref, off = _gpu_model(gen, mode)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del big  # the peak: 1 GiB above what a pass of this model allocates
    _same(ref, _step(model, x, off))
    st = off.stats()
    assert st["held_below_peak"] > 0 and st.get("offloaded_bytes", 0) == 0, st
    assert st["served_held"] > 0 and st.get("restored_prefetch", 0) == 0, st
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # every pass now raises the peak: stored
    model.zero_grad(set_to_none=True)
    _same(ref, _step(model, x, off))
    assert off.stats()["offloaded_bytes"] > 0, off.stats()
    torch.cuda.synchronize()
    assert off.pending()["entries"] == 0 and not _waiting(off)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["compressed", "uncompressed"])
def test_gpu_held_groups_are_read_in_place_with_identical_grads(gen, mode):
    model, x, ref, off = _gpu_model(gen, mode)
    for sync in (False, True, False):
        _same(ref, _step(model, x, off, off if sync else None))
    st = off.stats()
    assert st["served_held"] > 0 and st["offloaded_bytes"] > 0, st
    torch.cuda.synchronize()
    assert off.pending()["entries"] == 0 and off.pending()["stash"] == 0
    assert not _waiting(off)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_deferred_stores_keep_gradients_identical(gen, monkeypatch):
    """The compressed store on CUDA put off (``PagedStore.refusal`` naming a reason for a
    while, as when the link is behind): the due batches are held, then stored or read in
    place, the gradients stay identical, and the refusals are counted by their reason."""
    from torch_pagecomp.offload._paged import PagedStore

    model, x, ref, off = _gpu_model(gen)
    _same(ref, _step(model, x, off))
    real = PagedStore.refusal
    answers = []  # "backlog": the link is behind (the store would wait); then the arena's

    def refusal(self, n):
        return answers.pop() if answers else real(self, n)

    monkeypatch.setattr(PagedStore, "refusal", refusal)
    for behind in (3, 100):  # behind for a while; for the whole forward
        answers[:] = ["backlog"] * behind
        model.zero_grad(set_to_none=True)
        _same(ref, _step(model, x, off))
        torch.cuda.synchronize()
        assert off.pending()["entries"] == 0 and not _waiting(off)
    assert off.stats()["deferred"] > 0 and off.stats()["refused_backlog"] >= 1


@pytest.mark.peak_rule
def test_the_ab_probe_arms_set_the_window_and_put_it_back():
    """``bench.dev_ab_steps``' arms ``*_nohold`` (nothing held) change the window,
    ``memory_wait`` (due stores wait for the link) the deferral and ``*_eager`` (nothing held
    below the GPU's peak) the peak rule, while their steps run, and only then."""
    from bench.dev_ab_steps import _arm_patch
    from torch_pagecomp.offload._batch import Batcher

    off = _off()
    assert off._batcher.window == 2
    for arm in ("memory_nohold", "uncompressed_nohold"):
        with _arm_patch(arm):
            assert off._batcher.window == 0
        assert off._batcher.window == 2
    real = Batcher._starts_now
    with _arm_patch("memory_wait"):
        assert Batcher._starts_now is not real
    assert Batcher._starts_now is real
    with _arm_patch("memory_keep_deferred"):  # a deferred batch never starts again
        batch = types.SimpleNamespace(deferred=True)
        assert Batcher._starts_now(off._batcher, batch) is False
    assert Batcher._starts_now is real
    for arm in ("memory_eager", "uncompressed_eager"):  # never held below the peak
        with _arm_patch(arm):
            assert off._batcher._over_peak(torch.device("cuda")) is None
        assert off._batcher._over_peak.__func__ is Batcher._over_peak


@pytest.mark.peak_rule
def test_the_lastpeak_arm_holds_below_the_higher_of_the_two_peaks(monkeypatch):
    """``memory_lastpeak``: the line is the higher of the allocator's peak since its last
    reset and the store's last step peak (none noted yet: the first alone), put back after."""
    from bench.dev_ab_steps import _arm_patch
    from torch_pagecomp.offload import _batch
    from torch_pagecomp.offload._batch import Batcher

    off = _off()
    monkeypatch.setattr(_batch, "gpu_memory", lambda dev: (100, 150))
    off._batcher.last_group_bytes = 10
    dev = torch.device("cuda", 0)
    monkeypatch.setitem(off._paged, 0, types.SimpleNamespace(step_peak=None))
    with _arm_patch("memory_lastpeak"):
        assert off._batcher._over_peak(dev) == 100 + 2 * 10 - 150
        off._paged[0].step_peak = 300  # a higher last step: held below it
        assert off._batcher._over_peak(dev) == 100 + 2 * 10 - 300
        off._paged[0].step_peak = 120  # a lower one: the peak since the reset
        assert off._batcher._over_peak(dev) == 100 + 2 * 10 - 150
    assert off._batcher._over_peak.__func__ is Batcher._over_peak


def test_the_ab_probe_splits_the_timed_rounds_host_waits_by_cause():
    """``bench.dev_ab_steps``' table: the compressed stores' host waits for placements in the
    timed rounds (now less before), by why the host waited, seconds; nothing where none."""
    from bench.dev_ab_steps import _waits_by

    now = [{"host_wait_us_by": {"payload": 300_000, "room": 50_000}}, {"host_wait_us_by": {}}]
    before = [{"host_wait_us_by": {"payload": 100_000, "room": 50_000}}]
    assert _waits_by(now, before) == " (payload 0.200)"
    assert _waits_by([{}], []) == ""


def test_the_ab_probe_constant_arms_set_their_constants_and_put_them_back():
    """``bench.dev_ab_steps``' constant arms (``PATCHES``) set every constant they name while
    their steps run, and put each back after, also when a step raises."""
    from bench.dev_ab_steps import PATCHES, _arm_patch
    from torch_pagecomp.offload import _backward, _batch

    real = (_backward.RESTORE_BATCH_BYTES, _batch.BATCH_BYTES, _backward.BATCH_MIN_ENTRIES)
    with _arm_patch("memory_both"):
        assert (_backward.RESTORE_BATCH_BYTES, _batch.BATCH_BYTES) == (256 << 20, 128 << 20)
    with pytest.raises(RuntimeError, match="a step failed"), _arm_patch("memory_placed1"):
        assert _backward.BATCH_MIN_ENTRIES == 1
        raise RuntimeError("a step failed")
    assert (_backward.RESTORE_BATCH_BYTES, _batch.BATCH_BYTES,
            _backward.BATCH_MIN_ENTRIES) == real
    assert all(len(p) >= 1 for p in PATCHES.values())


def test_the_stock_bench_probe_sets_the_held_groups(monkeypatch):
    """``STOCK_HOLD_GROUPS`` (a probe of ``bench.stock_models``) sets the window of the hooks
    in its run, and each row records it; without it a row records the package's."""
    from bench import stock_models
    from torch_pagecomp.offload._batch import Batcher

    real = Batcher.window
    row = stock_models.run("encoder-tiny", "memory", 1, 1, "cpu", False)
    assert row["hold_groups"] == 2 and row["stats"]["held"] > 0
    monkeypatch.setenv("STOCK_HOLD_GROUPS", "0")
    monkeypatch.setattr(Batcher, "window", real)  # put back after the test, as the child exits
    row = stock_models.run("encoder-tiny", "memory", 1, 1, "cpu", False)
    assert row["hold_groups"] == 0 and "held" not in row["stats"] and row["offloaded_gib"] > 0


def test_the_stock_bench_probe_makes_due_stores_wait(monkeypatch):
    """``STOCK_WAIT=1`` (a probe of ``bench.stock_models``) makes every due store start at
    once in its run (``Batcher._starts_now`` always true: on a GPU the store then waits for
    the link), and each row records it."""
    from bench import stock_models
    from torch_pagecomp.offload._batch import Batcher

    real = Batcher._starts_now
    row = stock_models.run("encoder-tiny", "memory", 1, 1, "cpu", False)
    assert row["due_stores_wait"] is False
    monkeypatch.setenv("STOCK_WAIT", "1")
    monkeypatch.setattr(Batcher, "_starts_now", real)  # put back after the test
    row = stock_models.run("encoder-tiny", "memory", 1, 1, "cpu", False)
    assert row["due_stores_wait"] is True and Batcher._starts_now is not real
    assert row["offloaded_gib"] > 0


def test_the_ab_probe_runs_speed_to_its_choice_first():
    """``bench.dev_ab_steps``' ``speed`` arm runs its tuner's trials and check in steps of its
    own before the arms interleave, and reports its choice and those steps (a smoke test on
    the CPU's tiny model, also on a GPU host: on CUDA its saved tensors are below the default
    ``min_offload_bytes``, so nothing would be offloaded and the tuner would never choose)."""
    from bench.dev_ab_steps import measure

    lines = measure("encoder-tiny", ["uncompressed", "speed", "speed_copy_only"], 1, 1,
                    device="cpu")
    text = "\n".join(lines)
    mine = [ln for ln in lines if ln.startswith("speed: ")]
    assert len(mine) == 1 and "checking: False" in mine[0], text
    assert "choice None" not in mine[0], text
    steps = next(ln for ln in lines if ln.startswith("speed's own steps"))
    assert "comp" in steps and "copy" in steps, steps
    assert any(ln.startswith("| speed_copy_only |") for ln in lines), text


def test_the_ab_probe_settles_each_arm_until_a_block_pins_nothing(monkeypatch):
    """``dev_ab_steps.measure`` times an arm only after steps of its own in which a block's
    worth in a row pinned nothing (a plain copy's pool still growing pinned buffers in the
    timed steps, each costing the host milliseconds), at most ``settle`` steps, and says how
    many each took and whether it settled (also in the rows)."""
    from bench import dev_ab_steps

    pins = {"n": 0}
    growing = {"uncompressed": 5, "memory": 100}  # pins while the arm takes its first steps

    def fake_chunks(off):
        arm = "memory" if off.mode == "compressed" else "uncompressed"
        seen = pins.setdefault(arm, 0)
        if seen < growing[arm]:
            pins[arm] = seen + 1
            return (seen + 1, 0)
        return (seen, 0)

    monkeypatch.setattr(dev_ab_steps, "_chunks", fake_chunks)
    rows: list[dict] = []
    lines = dev_ab_steps.measure("encoder-tiny", ["none", "uncompressed", "memory"], 1, 1,
                                 block=2, device="cpu", rows=rows, settle=6)
    line = next(ln for ln in lines if ln.startswith("settling steps"))
    assert "at most 6" in line and "memory 6 (still pinning)" in line, line
    got = {r["variant"]: (r.get("settling_steps"), r.get("settled")) for r in rows}
    assert got["memory"] == (6, False) and got["uncompressed"][1] is True, got
    timed = {r["variant"]: r.get("pinned_in_timed_steps") for r in rows}
    assert timed["uncompressed"] == 0 and timed["memory"] > 0, timed  # still growing there
    assert 2 <= got["uncompressed"][0] <= 6 and "settling_steps" not in rows[0], got
    none = dev_ab_steps.measure("encoder-tiny", ["none", "uncompressed"], 1, 1, device="cpu",
                                settle=0)
    assert next(ln for ln in none if ln.startswith("settling")).endswith("uncompressed 0 "
                                                                          "(still pinning)")


def test_the_ab_probe_runs_the_collector_by_hand_or_records_its_pauses(monkeypatch):
    """``dev_ab_steps.measure``'s ``gc_mode``: ``"manual"`` turns automatic collection off
    for the steps and collects generation 1 after each, outside its time; ``"auto"``
    records the automatic collections' pauses against the arm whose step ran. Either way
    each arm's collector ms a step is in the table and rows, and the collector is left as it
    was, also when a step raises."""
    import gc

    from bench.dev_ab_steps import measure

    assert gc.isenabled()
    rows: list[dict] = []
    lines = measure("encoder-tiny", ["none", "uncompressed"], 2, 1, device="cpu", rows=rows)
    line = next(ln for ln in lines if ln.startswith("gc manual"))
    assert "none " in line and "uncompressed " in line, line
    assert gc.isenabled() and all(r["gc"] == "manual" and r["gc_ms_per_step"] > 0
                                  for r in rows), rows
    old = gc.get_threshold()
    gc.set_threshold(1)  # a collection at every allocation: some inside each step
    try:
        rows = []
        lines = measure("encoder-tiny", ["none", "uncompressed"], 2, 1, device="cpu",
                        rows=rows, gc_mode="auto")
    finally:
        gc.set_threshold(*old)
    line = next(ln for ln in lines if ln.startswith("gc auto"))
    assert all(r["gc"] == "auto" and r["gc_ms_per_step"] > 0 for r in rows), (line, rows)
    assert not any(cb.__qualname__.startswith("_Collector") for cb in gc.callbacks)

    def fails(self, *args, **kwargs):
        raise RuntimeError("a step that fails")

    monkeypatch.setattr(torch.optim.SGD, "step", fails)
    with pytest.raises(RuntimeError, match="a step that fails"):
        measure("encoder-tiny", ["none", "uncompressed"], 1, 1, device="cpu")
    assert gc.isenabled()


def test_the_ab_probe_closes_its_offloaders(monkeypatch):
    """``dev_ab_steps.measure`` closes every arm's offloader once its tables are made (their
    GPU scratch and page-locked memory would otherwise sit under the next model's peaks in
    the same process), and says what was allocated before the model."""
    from bench.dev_ab_steps import measure

    closed = []
    real = ActivationOffloader.close

    def close(self):
        closed.append(self)
        real(self)

    monkeypatch.setattr(ActivationOffloader, "close", close)
    lines = measure("encoder-tiny", ["uncompressed", "memory", "none"], 1, 1, device="cpu")
    assert "GPU memory allocated before the model" in lines[0], lines[0]
    timed = [c for c in closed if c.counters["packed"] > 0]
    assert len(timed) == 2 and all(c.host_bytes() == 0 for c in timed), closed


def test_the_ab_probe_says_when_the_model_diverged(monkeypatch):
    """``dev_ab_steps.measure`` reports the model's health: every arm's losses and every
    parameter finite ("ok"), or DIVERGED, with the rows' ``loss_finite`` and
    ``params_finite`` false: a model gone to inf / NaN stores pages (one value repeated) that
    compress far beyond real activations, and its rows would compare codecs on them."""
    from bench.dev_ab_steps import measure

    rows: list[dict] = []
    lines = measure("encoder-tiny", ["none", "uncompressed"], 1, 1, device="cpu", rows=rows)
    health = next(ln for ln in lines if ln.startswith("model health"))
    assert health.startswith("model health: ok"), health
    assert rows and all(r["loss_finite"] and r["params_finite"] for r in rows), rows

    real = torch.optim.SGD.step

    def poisoned(self, *args, **kwargs):  # the update makes one weight NaN: so does the loss
        out = real(self, *args, **kwargs)
        self.param_groups[0]["params"][0].data.view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.SGD, "step", poisoned)
    rows = []
    lines = measure("encoder-tiny", ["none", "uncompressed"], 1, 1, device="cpu", rows=rows)
    health = next(ln for ln in lines if ln.startswith("model health"))
    assert "DIVERGED" in health and "parameters finite: False" in health, health
    assert rows and not any(r["loss_finite"] or r["params_finite"] for r in rows), rows


def _slow_optimizer_steps(monkeypatch) -> list[float]:
    """Each SGD step sleeps 20 ms (the GIL released): a 1 ms stall watch then fires inside
    every step, whatever the host's speed (a tiny CPU step can end before the watch's thread
    gets the GIL, and no dump is printed). Returns the list each sleep's measured ms is
    appended to: on a loaded host a 20 ms sleep can take several times that."""
    import time

    real = torch.optim.SGD.step
    slept: list[float] = []

    def slow(self, *args, **kwargs):
        t0 = time.perf_counter()
        time.sleep(0.02)
        slept.append((time.perf_counter() - t0) * 1e3)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", slow)
    return slept


def test_the_ab_probe_names_the_arm_and_step_of_a_stalled_step(capsys, monkeypatch):
    """``dev_ab_steps --stall-dump S`` (``measure(stall_s=...)``): a step whose host part runs
    past ``S`` prints its stacks under its model, arm and step (here every step: 1 ms), so a
    stall in interleaved steps is pinned to its arm; without it nothing is printed."""
    from bench.dev_ab_steps import measure

    _slow_optimizer_steps(monkeypatch)
    measure("encoder-tiny", ["uncompressed", "memory"], 1, 0, device="cpu", stall_s=0.001)
    err = capsys.readouterr().err
    assert "Stall: encoder-tiny memory step " in err, err[-2000:]
    assert "Stall: encoder-tiny uncompressed step " in err, err[-2000:]
    measure("encoder-tiny", ["memory"], 1, 0, device="cpu")
    assert "Stall:" not in capsys.readouterr().err


def test_the_ab_probe_samples_where_each_arms_host_time_went(monkeypatch):
    """``dev_ab_steps --sample-host MS``: per arm, the innermost frames of the timed steps in
    ms a step. Each optimizer step here sleeps 20 ms: that frame must be among this
    thread's rows of every arm's table, at about the time those sleeps
    measured (the samples scaled by their measured interval), and in the package's column
    that time is outside the package ("-")."""
    import bench.dev_ab_steps as ab

    slept = _slow_optimizer_steps(monkeypatch)
    lines = ab.measure("encoder-tiny", ["uncompressed", "memory"], 3, 1, device="cpu",
                       sample_ms=1.0)
    text = "\n".join(lines)
    for arm in ("uncompressed", "memory"):
        table = text.split(f"#### {arm}:")[1].split("####")[0]
        rows = [[c.strip() for c in ln.strip("| ").split("|")] for ln in table.splitlines()[3:]
                if ln.startswith("|")]
        # this thread's rows (other threads, idle ones too, have rows of their own); the
        # sleep's among them (its rank varies with the host's load: on a GPU host beside other
        # GPU jobs this tiny CPU step took 285 ms, its frames ahead of the 20 ms sleep)
        mine = [r[1:3] for r in rows if r[0] == "main"]
        leaf = next((r for r in mine if r[0].startswith("test_offload_hold.py:slow")), None)
        assert leaf is not None, (max(slept), table[:1500])
        ours = next(r[5:7] for r in rows if r[4] == "main")
        # at least most of a 20 ms sleep, at most 2.5 times the longest sleep measured (a
        # loaded host stretches the sleeps and the sampler's intervals unevenly: with a
        # second test process on this 2-core host, 32.8 ms sampled against sleeps of 20.9)
        assert 12.0 < float(leaf[1]) < 2.5 * max(slept), (max(slept), table[:1500])
        assert ours[0] == "-" and float(ours[1]) >= float(leaf[1]), table[:1500]
    assert "page-locked buffers pinned / unpinned" in text


def test_the_step_modes_probe_reports_each_step():
    """``bench.dev_step_modes`` prints one row per step with what the step did (a smoke test
    on the CPU's tiny model): the compressed offloads it made are among its counters."""
    from bench.dev_step_modes import measure

    lines = measure("resnet-tiny", "memory", 3, 1, device="cpu")
    rows = [ln for ln in lines if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == 3, "\n".join(lines)
    assert all("offloaded_compressed" in r for r in rows), "\n".join(lines)


def test_the_step_modes_probe_prints_the_stacks_of_a_stalled_step(capsys, monkeypatch):
    """``dev_step_modes --stall-dump S``: a step whose host part runs past ``S`` seconds prints
    the Python stacks then (here every step: 1 ms), the step's own first, naming this probe;
    a run without it, and a watch cancelled in time, print none."""
    from bench.dev_step_modes import StallWatch, measure

    _slow_optimizer_steps(monkeypatch)
    measure("resnet-tiny", "memory", 2, 0, device="cpu", stall_s=0.001)
    err = capsys.readouterr().err
    assert "Stall: the step's host part ran past 0.001 s" in err, err[-2000:]
    first = err.split("Stall:")[1]
    assert "dev_step_modes.py" in first.split("Thread")[1], first[:2000]
    measure("resnet-tiny", "memory", 1, 0, device="cpu")
    StallWatch(60.0).cancel()
    assert "Stall:" not in capsys.readouterr().err


def test_the_step_modes_probe_shows_the_speed_tuners_retunes():
    """``dev_step_modes --arm speed --retune N``: each step's tuner arm and phase, so a
    retune's passes (trials again) show among settled ones; ``growth`` is restored after."""
    from bench.dev_step_modes import measure
    from torch_pagecomp.offload import _tune

    real = _tune.RETUNE_GROWTH
    lines = measure("encoder-tiny", "speed", 24, 0, device="cpu", retune=3, growth=1)
    assert _tune.RETUNE_GROWTH == real
    rows = [ln for ln in lines if ln.startswith("| ") and ln[2].isdigit()]
    phases = [r.rstrip(" |").rsplit("(", 1)[-1].rstrip(")") for r in rows]
    assert "settled" in phases and "trial" in phases[phases.index("settled"):], phases


def test_the_ab_probe_runs_under_fsdp2_on_two_ranks(tmp_path):
    """``torchrun -m bench.dev_ab_steps --fsdp`` (FSDP2 over two gloo ranks on the CPU, tiny
    model): both ranks take the same steps (``speed``'s own steps go on while either rank's
    tuner has not settled, else their collectives would part), rank 0 prints the table and
    writes the JSON rows, two GPUs' worth of gradient shards identical to no offload."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "bench.dev_ab_steps", "--fsdp", "--device", "cpu", "--models", "encoder-tiny",
           "--arms", "uncompressed,speed", "--rounds", "1", "--warmup", "1",
           "--out", str(tmp_path / "ab.json")]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("## encoder-tiny (FSDP2)") == 1, r.stdout  # rank 0 only
    assert "| speed |" in r.stdout and "speed: " in r.stdout, r.stdout
    doc = json.loads((tmp_path / "ab.json").read_text())
    assert doc["gpus"] == 2 and doc["method"] == "interleaved"
    assert [r["variant"] for r in doc["rows"]] == ["uncompressed", "speed"]
    assert all(r["grads_identical"] is True for r in doc["rows"]), doc["rows"]
    # each rank's tuner decides alone: the probe says what each chose
    assert "speed on each rank: choices" in r.stdout, r.stdout
    choices = doc["rows"][1]["tuner_choice_by_rank"]
    assert len(choices) == 2 and set(choices) <= {"compress", "copy"}, choices


def test_the_ab_probe_says_where_the_ranks_tuners_parted():
    """``dev_ab_steps._ranks_line`` counts the passes whose arm differed between ranks, and
    lists each rank's choice (the FSDP2 probe's check that no rank ran the other way)."""
    from bench.dev_ab_steps import _ranks_line

    same = _ranks_line("speed", [("copy", ["compress", "copy"], "copy")] * 2)
    assert same.endswith("differed between ranks in 0 of 2"), same
    apart = _ranks_line("speed", [("copy", ["compress", "copy", "copy"], "copy"),
                                  ("compress", ["compress", "compress", "copy"], "compress")])
    assert "choices ['copy', 'compress']" in apart and apart.endswith("in 1 of 3"), apart


def test_the_ab_probe_writes_stock_rows_with_a_gradient_check_that_can_fail(monkeypatch):
    """``dev_ab_steps.measure(rows=...)`` adds ``bench.stock_models``' JSON rows for none /
    save_on_cpu / uncompressed / memory / speed, measured interleaved, each arm's first
    gradients set against a step without offload: identical with the real stores, not
    identical once the CPU store's restore flips a byte (so the check can fail)."""
    from bench.dev_ab_steps import measure
    from torch_pagecomp.offload._stores import CpuStore

    rows: list[dict] = []
    measure("encoder-tiny", ["none", "save_on_cpu", "uncompressed", "memory"], 1, 1,
            device="cpu", rows=rows)
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"none", "save_on_cpu", "uncompressed", "memory"}
    for key in ("model", "gpus", "step_ms", "peak_gpu_gib", "host_gib", "ratio", "link_bound"):
        assert key in by["memory"], key
    assert by["uncompressed"]["grads_identical"] is True
    assert by["memory"]["grads_identical"] is True
    # torch's save_on_cpu(pin_memory=True) restores contiguous copies of saved views: the
    # backward then runs on other strides, and on some hosts rounds otherwise (this VM's
    # AVX2 build, 2026-12-02: bf16 gradients up to 2.4e-4 apart, where pin_memory=False,
    # which keeps the tensor itself, gives identical ones). So its row only says whether
    # they matched. It moves every saved byte: as much host memory as a plain copy, or more
    assert by["save_on_cpu"]["grads_identical"] in (True, False)
    assert by["save_on_cpu"]["host_gib"] >= 0.9 * by["uncompressed"]["host_gib"] > 0
    assert by["memory"]["ratio"] > 1.0
    # the hooks' own host time per timed step, set against the step's host issue time
    assert 0 < by["memory"]["hook_host_ms"]["pack"] < by["memory"]["step_ms"]
    # and what they did per timed step: every saved tensor went through the pack hook
    per = by["memory"]["counters_per_step"]
    assert per["packed"] >= per.get("offloaded_compressed", 0) > 0, per

    real = CpuStore.restore

    def corrupt(self, stored, out):
        real(self, stored, out)
        out.view(torch.uint8).view(-1)[0] ^= 0x40  # one flipped bit in the restored bytes

    monkeypatch.setattr(CpuStore, "restore", corrupt)
    rows = []
    measure("encoder-tiny", ["none", "memory"], 1, 1, device="cpu", rows=rows)
    assert {r["variant"]: r for r in rows}["memory"]["grads_identical"] is False


def test_the_ab_probe_checks_gradients_on_offloaders_of_their_own(monkeypatch):
    """Each offloading arm's gradient check runs on an offloader of the arm's settings made
    for it and closed after: the timed offloaders pack only in the warm-up, settling and
    timed steps (as many a step as the check's), and the check's hold nothing once closed."""
    import bench.dev_ab_steps as ab
    import torch_pagecomp

    made = []

    class Recorded(torch_pagecomp.ActivationOffloader):
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(self)

    monkeypatch.setattr(torch_pagecomp, "ActivationOffloader", Recorded)
    rows: list[dict] = []
    warmup, rounds = 1, 2
    ab.measure("encoder-tiny", ["none", "uncompressed", "memory"], rounds, warmup,
               device="cpu", rows=rows)
    assert len(made) == 4  # the two timed arms' first, then a check's each
    timed, checks = made[:2], made[2:]
    assert [o.mode for o in timed] == [o.mode for o in checks]
    settled = {r["variant"]: r["settling_steps"] for r in rows if "settling_steps" in r}
    for t, c in zip(timed, checks):
        per_step = c.counters["packed"]
        steps = warmup + rounds + settled[t.mode if t.mode == "uncompressed" else "memory"]
        assert per_step > 0 and t.counters["packed"] == steps * per_step
        assert c.pending()["entries"] == 0 and c.pool.held_bytes == 0 and not c._paged
    assert all(r["grads_identical"] for r in rows if r["variant"] != "none")


def test_the_ab_probe_counts_host_peaks_of_the_timed_rounds_only(monkeypatch):
    """The JSON rows' ``host_gib`` is the peak of the timed rounds: a step before them that
    offloads far more (as the gradient check's math-SDPA steps do on a GPU) is not in it."""
    import bench.dev_ab_steps as ab
    import torch_pagecomp
    from bench.stock_models import build
    from torch_pagecomp import offload_module

    _, x, _ = build("encoder-tiny", "cpu")
    real, seen, made = ab._first_grads, [], []

    class Recorded(torch_pagecomp.ActivationOffloader):
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(self)

    monkeypatch.setattr(torch_pagecomp, "ActivationOffloader", Recorded)

    def with_a_big_step(model, forward, blocks, arms, fsdp, make):
        out = real(model, forward, blocks, arms, fsdp, make)
        off = made[0]  # the timed arm's (the check's own are made after it)
        offload_module(model, blocks=blocks, offloader=off)
        try:
            model(x.repeat(8, 1, 1)).float().square().mean().backward()
        finally:
            off.remove()
        model.zero_grad(set_to_none=True)
        seen.append(off.stats()["peak_host_bytes"])
        return out

    monkeypatch.setattr(ab, "_first_grads", with_a_big_step)
    rows: list[dict] = []
    ab.measure("encoder-tiny", ["none", "uncompressed"], 1, 1, device="cpu", rows=rows)
    unc = {r["variant"]: r for r in rows}["uncompressed"]
    assert 0 < unc["host_gib"] * 2**30 < seen[0] / 4, (unc["host_gib"] * 2**30, seen)


def test_the_ab_probe_pairs_each_round_with_the_base_arms():
    """``dev_ab_steps.paired``: each round's step over the base arm's step of that round
    (not the medians' ratio), median and quartiles; a host that slows both arms alike in a
    round leaves their ratios alone."""
    from bench.dev_ab_steps import paired

    base = [100.0, 200.0, 100.0, 300.0, 100.0]
    assert paired([110.0, 220.0, 110.0, 330.0, 110.0], base) == "1.10x (1.10-1.10)"
    assert paired([90.0, 180.0], base[:2]) == "0.90x"
    got = paired([100.0, 240.0, 90.0, 300.0, 120.0], base)
    assert got.startswith("1.00x (") and got != "1.00x (1.00-1.00)", got


def test_the_leftover_probe_groups_live_blocks_by_their_frames():
    """``bench.dev_leftover``: the blocks still allocated on the device asked about, by their
    innermost Python frames; freed blocks, other devices and non-Python frames count nothing."""
    from bench.dev_leftover import frames_key, leftover

    fr = [{"filename": "/x/fsdp/_param.py", "line": 7, "name": "alloc"},
          {"filename": "??", "line": 0, "name": "c10::alloc"},
          {"filename": "/y/bench/run.py", "line": 3, "name": "step"}]
    key = frames_key(fr)
    assert key == "_param.py:7:alloc < run.py:3:step", key
    snap = {"segments": [
        {"device": 0, "blocks": [{"size": 512, "state": "active_allocated", "frames": fr},
                                 {"size": 256, "state": "inactive", "frames": fr},
                                 {"size": 128, "state": "active_allocated"}]},
        {"device": 1, "blocks": [{"size": 1024, "state": "active_allocated", "frames": fr}]}]}
    assert leftover(snap, 0) == {key: 512, "?": 128}
    assert leftover(snap, 1) == {key: 1024}


def test_the_chaos_probe_sets_every_step_against_no_offload(monkeypatch):
    """``bench.dev_chaos.run``: every step of every arm set against the gradients without
    offload; none differ with the real stores, and every offloading step differs once the CPU
    store's restore flips a bit (so the probe can see what it hunts). On the CPU no delays are
    queued (``torch.cuda._sleep``); the GPU runs them (``gpu_suite.sh chaos``)."""
    from bench.dev_chaos import run
    from torch_pagecomp.offload._stores import CpuStore

    bad, lines = run("encoder-tiny", ["uncompressed", "memory"], 2, "cpu", None)
    assert bad == 0 and "2 rounds of uncompressed, memory" in lines[-1], lines
    real = CpuStore.restore

    def corrupt(self, stored, out):
        real(self, stored, out)
        out.view(torch.uint8).view(-1)[0] ^= 0x40

    monkeypatch.setattr(CpuStore, "restore", corrupt)
    bad, lines = run("encoder-tiny", ["uncompressed", "memory"], 2, "cpu", None)
    assert bad == 4 and "4 steps differed" in lines[-1], lines


def test_the_ab_probe_prints_the_host_slack_against_the_hooks_extra_host_time():
    """``dev_ab_steps``' slack line: the plain copy's step less its host issue time, and each
    other arm's hooks' host ms a step over the plain copy's (session 74: which of the two is
    larger told whether compressing beat the plain copy on every model); each row carries its
    arm's host issue ms."""
    from bench.dev_ab_steps import measure, slack_line

    res = {"uncompressed": ([60.0, 58.0, 62.0], [50.0, 51.0, 52.0]),
           "memory": ([70.0], [66.0])}
    done = {"uncompressed": ({"pack": 10.0, "unpack": 5.0}, {}),
            "memory": ({"pack": 20.0, "unpack": 8.5}, {})}
    line = slack_line(res, done)
    assert "host issue time 9.0 ms" in line and "memory 13.5" in line, line
    assert slack_line({"memory": res["memory"]}, {"memory": done["memory"]}) is None
    rows: list[dict] = []
    lines = measure("encoder-tiny", ["none", "uncompressed", "memory"], 1, 1, device="cpu",
                    rows=rows)
    assert sum(ln.startswith("host slack: ") and "memory " in ln for ln in lines) == 1, lines
    got = {r["variant"]: r.get("host_issue_ms") for r in rows}
    assert all(v is not None and v > 0 for v in got.values()), got


def test_the_ab_probe_prints_each_arms_rounds_apart():
    """``dev_ab_steps``' drift line: each arm's median step by round and its slowest round
    over its fastest; none for one round; a real run (blocks of 2 steps, 2 rounds) prints it."""
    from bench.dev_ab_steps import measure, rounds_line

    line = rounds_line({"uncompressed": [150.0, 152.0, 176.0, 180.0],
                        "memory": [190.0, 186.0, 170.0, 172.0]}, 2)
    assert line.endswith("uncompressed 151.0 / 178.0 (1.18x); memory 188.0 / 171.0 (1.10x)"), \
        line
    assert rounds_line({"memory": [1.0, 2.0]}, 1) is None
    lines = measure("encoder-tiny", ["uncompressed", "memory"], 2, 1, device="cpu", block=2)
    assert sum(ln.startswith("each arm's median step ms by round") for ln in lines) == 1, lines


def test_the_ab_probe_prints_why_stores_were_put_off():
    """``dev_ab_steps``' refusal line: each arm's due stores put off a step by the reason
    (``refused_backlog`` / ``refused_payload`` / ``refused_room``) and its members put off;
    none where no arm put one off."""
    from bench.dev_ab_steps import refused_line

    done = {"uncompressed": ({}, {"offloaded_raw": 4.0}),
            "memory": ({}, {"refused_backlog": 29.5, "refused_payload": 7.75,
                            "deferred": 97.25})}
    line = refused_line(done)
    assert line.endswith("memory 29.5 / 7.8 / 0.0 (members put off 97.2)"), line
    assert "uncompressed" not in line
    assert refused_line({"uncompressed": done["uncompressed"]}) is None


@pytest.mark.parametrize("arm", ["memory_tail15", "memory_tail30"])
def test_the_tail_arms_store_nothing_due_in_the_forwards_last_bytes(gen, arm):
    """``bench.dev_ab_steps``' ``memory_tail*`` arms: once a pass has saved ``1 - frac`` of
    the last pass's bytes, no due batch is stored (held for the backward instead): a 16-group
    forward holds more than the window's two groups at its end, its gradients unchanged; the
    first pass (no last pass known) stores as the package does; the patch goes after."""
    from bench.dev_ab_steps import _arm_patch
    from torch_pagecomp.offload._batch import Batcher

    real = (Batcher.add, Batcher.store_due)
    model, x = _model(gen, layers=16), _data(gen, ROWS, WIDTH)
    ref = _step(model, x)
    held = {}
    for name in ("package", arm):
        off = _off()
        with _arm_patch(name if name != "package" else "memory"):
            for _ in range(2):  # the first pass has no last pass to take its tail from
                _same(ref, _step(model, x, off))
            with off:
                loss = model(x)
            held[name] = off._batcher.members
            loss.backward()
        assert off.pending()["entries"] == 0
    frac = int(arm[len("memory_tail"):]) / 100
    assert held["package"] <= 3 * 2  # the window: two groups (a few saves each)
    assert held[arm] > held["package"]
    assert held[arm] >= int(frac * 16) * 2
    assert (Batcher.add, Batcher.store_due) == real
