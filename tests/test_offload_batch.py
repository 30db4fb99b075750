"""Saved storages stored together (``torch_pagecomp.offload._batch``): gradients, views,
dedup, versions, flush points and failures.

CPU tests run the hooks on CPU tensors (``offload_cpu=True``: the compressed CPU store), where
batching works as on the GPU (one ``torch.cat``, one stored entry); the GPU test runs the
compressed store on CUDA. Every run draws fresh weights and inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torch_pagecomp.offload import ActivationOffloader, _batch
from torch_pagecomp.offload._entry import _Packed

CUDA = torch.cuda.is_available()
P = 4096


class MLP(nn.Module):
    """Every saved activation is whole pages (``rows x width`` fp32 / bf16, width a multiple
    of 1024 elements), so every offloaded storage of a decided class may join a batch."""

    def __init__(self, width: int = 1024, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x)) * x.sigmoid()  # tanh, sigmoid, mul: several saves a layer
        return x.float().square().mean()


def _data(gen, rows: int, width: int, device="cpu", dtype=torch.float32):
    x = torch.randn(rows, width, generator=gen).to(device, dtype)
    # a value range that compresses: most exponents repeat
    return (x * 0.01).round(decimals=2).requires_grad_(False)


def _step(model, x, ctx=None, sync=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(x)
    else:
        with ctx:
            loss = model(x)
    if sync is not None:
        sync.synchronize()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _off(**kw) -> ActivationOffloader:
    """A CPU offloader whose classes compress. ``prefetch=0`` unless given: nothing is held
    for the backward, so these tests see batches stored at the flush points (the held window
    has its own tests below)."""
    kw.setdefault("prefetch", 0)
    kw.setdefault("min_offload_bytes", P)
    kw.setdefault("group_bytes", None)
    kw.setdefault("min_ratio", 0.0)  # every class compresses, whatever its data's ratio
    kw.setdefault("sample_tensors", 1)
    return ActivationOffloader(offload_cpu=True, prefer="memory", **kw)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _model(gen, width=1024, layers=4, device="cpu", dtype=torch.float32):
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    return MLP(width, layers).to(device, dtype)


def _decided(gen, **kw):
    """``(model, x, reference gradients, offloader)`` after one offloaded step (the classes
    are sampled and decided: the next step batches), gradients zeroed."""
    model, x = _model(gen), _data(gen, 24, 1024)
    ref = _step(model, x)
    off = _off(**kw)
    _step(model, x, off)
    model.zero_grad(set_to_none=True)
    return model, x, ref, off


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _waiting(off) -> bool:
    """Whether a batch waits to be stored."""
    return bool(off._batcher.open or off._batcher.held)


@pytest.mark.parametrize("sync", [False, True])
def test_batched_gradients_are_bit_identical(gen, sync):
    model, x = _model(gen), _data(gen, 24, 1024)
    ref = _step(model, x)
    off = _off()
    for _ in range(3):  # the first step samples the classes; later ones batch them
        got = _step(model, x, off, off if sync else None)
        _same(ref, got)
    st = off.stats()
    assert st["batched"] > 0, st
    assert st["entries"] == 0 and st["host_bytes"] == 0  # all freed after backward
    # counted per saved storage, batched or not
    assert st["offloaded_compressed"] == st.get("compressed_exp", 0) + st["compressed_lz4"]


def test_a_batch_holds_several_tensors_at_page_offsets(gen, monkeypatch):
    from torch_pagecomp.offload import _hooks

    model, x = _model(gen, layers=3), _data(gen, 16, 1024)
    off = _off()
    _step(model, x, off)  # the classes are sampled
    mine = []

    class Spy(_Packed):
        __slots__ = ()

        def __init__(self, *a):
            super().__init__(*a)
            mine.append(self)

    monkeypatch.setattr(_hooks, "_Packed", Spy)
    with off:
        loss = model(x)
    entries = {id(p.entry): p.entry for p in mine}
    assert len(entries) < len(mine)  # several tensors share a stored entry
    for e in entries.values():
        assert e.nbytes % P == 0 and e.stored is not None  # stored when the pass ended
    bases = {(id(p.entry), p.offset * p.dtype.itemsize) for p in mine}
    assert all(b % P == 0 for _, b in bases) and any(b > 0 for _, b in bases)
    model.zero_grad(set_to_none=True)
    loss.backward()
    mine.clear()  # the test's references kept the entries alive
    del entries, e
    assert off.pending()["entries"] == 0


def test_views_dedup_and_offsets_inside_a_batch(gen):
    """A storage saved twice (dedup), and a view at a storage offset, inside one batch."""
    w = torch.randn(1024, 1024, generator=gen).mul(0.01).requires_grad_()

    def f(x):
        h = x @ w  # saves x
        y = h.sin() * h.cos()  # saves h twice (sin, cos) and both products
        z = y[2:].exp()  # a view at a storage offset, saved by exp (its result)
        return (z * y[2:]).sum() + (h * x).sum()

    x = _data(gen, 32, 1024).requires_grad_()
    ref = torch.autograd.grad(f(x), (w, x))
    off = _off()
    for _ in range(3):
        with off:
            loss = f(x)
        _same(ref, torch.autograd.grad(loss, (w, x)))
    st = off.stats()
    assert st["batched"] > 0 and st["deduplicated"] > 0, st


def test_backward_inside_the_with_block_stores_the_waiting_batch_first(gen):
    model, x, ref, off = _decided(gen)
    with off:
        loss = model(x)
        assert _waiting(off)  # a batch waits: nothing ended it yet
        loss.backward()  # its first unpack stores it
        assert not _waiting(off)
    _same(ref, _grads(model))


def test_a_kept_tensor_unpacked_first_still_prefetches_the_waiting_batch(gen):
    """Groups of one storage (96 KiB), the last two held: the kept tensor's unpack comes
    first, the held ones are read in place and every other group is prefetched."""
    model, x = _model(gen), _data(gen, 24, 1024)
    off = _off(prefetch=1, group_bytes=96 << 10)
    _step(model, x, off)
    before = off.stats().get("restored_on_demand", 0)
    scale = torch.full((256, 1024), 2.0)
    model.zero_grad(set_to_none=True)
    (model(x) * scale.exp().mean()).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with off:
        loss = model(x)
        with off.keep_on_gpu():
            loss = loss * scale.exp().mean()  # kept: unpacked first
        assert _waiting(off)
        loss.backward()
    _same(ref, _grads(model))
    st = off.stats()
    assert st.get("restored_on_demand", 0) == before and st["restored_prefetch"] > 0, st
    assert st["served_held"] > 0, st


def test_in_place_change_after_a_batched_save_raises(gen):
    off = _off()
    w = torch.randn(1024, 1024, generator=gen).requires_grad_()
    for step in range(2):  # the first samples the class, the second batches
        x = _data(gen, 16, 1024)
        with off:
            h = x @ w
            y = h.sin()  # saves h
        if step == 0:
            y.sum().backward()
            continue
        assert off.stats()["batched"] > 0
        h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_a_batch_that_fails_to_store_stays_in_place(gen, monkeypatch):
    model, x = _model(gen), _data(gen, 24, 1024)
    ref = _step(model, x)
    off = _off()
    _step(model, x, off)  # the classes are decided: the next step batches

    def failing(*a):
        raise RuntimeError("no host memory")

    monkeypatch.setattr(off._cpu_compressed, "offload", failing)
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="offloads failed and stayed in place"), off:
        loss = model(x)
    assert len(off._failed) > 0  # batches whose store failed: their members kept in place
    loss.backward()
    _same(ref, _grads(model))
    st = off.stats()
    assert st["offload_failed"] > 0 and "no host memory" in st["last_offload_error"]
    assert st["failed"] == 0 and st["entries"] == 0  # dropped at the end of backward


def test_a_batch_whose_cat_runs_out_of_memory_keeps_its_members(gen, monkeypatch):
    """Out of memory for the batch's ``torch.cat`` (offload runs where memory is short): each
    saved tensor is served from its own storage, none is lost."""
    model, x = _model(gen), _data(gen, 24, 1024)
    ref = _step(model, x)
    off = _off()
    _step(model, x, off)
    real = _batch.joined
    failed = []

    def short_of_memory(entry):
        if len(entry.parts) > 1:
            failed.append(len(entry.parts))
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(entry)

    monkeypatch.setattr(_batch, "joined", short_of_memory)
    with pytest.warns(UserWarning, match="offloads failed and stayed in place"):
        _same(ref, _step(model, x, off))  # (said once per offloader)
    _same(ref, _step(model, x, off))
    assert failed and off.stats()["offload_failed"] >= sum(failed)
    assert off.pending()["failed"] == 0 and off.pending()["entries"] == 0


@pytest.mark.parametrize("rows", [3, 10_000])
def test_partial_pages_and_large_storages_are_stored_alone(gen, monkeypatch, rows):
    """3 x 1000 fp32 (a partial last page) and 10000 x 1000 (more than half a batch at a
    small ``BATCH_BYTES``) never join a batch."""
    monkeypatch.setattr(_batch, "BATCH_BYTES", 1 << 20)
    w = torch.randn(1000, 1000, generator=gen).mul(0.01).requires_grad_()
    x = _data(gen, rows, 1000)
    ref = torch.autograd.grad((x @ w).sin().sum(), w)
    off = _off()
    for _ in range(2):
        with off:
            loss = (x @ w).sin().sum()
        _same(ref, torch.autograd.grad(loss, w))
    assert off.stats().get("batched", 0) == 0


def test_batches_stay_within_batch_bytes_and_groups(gen, monkeypatch):
    monkeypatch.setattr(_batch, "BATCH_BYTES", 64 << 10)
    model, x = _model(gen, layers=4), _data(gen, 8, 1024)  # 32 KiB a storage: two a batch
    ref = _step(model, x)
    off = _off(group_bytes=96 << 10)
    sizes = []
    real = off._batcher.flush

    def spy(batch):
        sizes.append((batch.nbytes, batch.members))
        real(batch)

    monkeypatch.setattr(off._batcher, "flush", spy)
    for _ in range(2):
        _same(ref, _step(model, x, off))
    assert sizes and all(n <= 64 << 10 for n, _ in sizes), sizes
    assert any(k == 2 for _, k in sizes), sizes
    assert off.pending()["entries"] == 0


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_batched_gradients_are_bit_identical(gen, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(gen, width=2048, layers=4, device="cuda", dtype=dtype)
    x = _data(gen, 512, 2048, "cuda", dtype)
    ref = _step(model, x)
    off = ActivationOffloader(prefer="memory", min_offload_bytes=P, group_bytes=None,
                              min_ratio=0.0, sample_tensors=1, prefetch=0)
    for sync in (False, True, False):
        _same(ref, _step(model, x, off, off if sync else None))
    st = off.stats()
    assert st["batched"] > 0, st
    assert st["batched_in_place"] > 0, st  # their compress read the members where they lay
    torch.cuda.synchronize()
    assert off.pending()["entries"] == 0 and off.pending()["stash"] == 0


def _batching_bf16_model(gen):
    """``(model, x, reference gradients, offloader)``: a bf16 model on the GPU whose saved
    tensors the offloader (``prefer="memory"``, no window: ``prefetch=0``) stores in batches
    from the next step on (one step run under it decided their classes)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(gen, width=2048, layers=4, device="cuda", dtype=torch.bfloat16)
    x = _data(gen, 512, 2048, "cuda", torch.bfloat16)
    ref = _step(model, x)
    off = ActivationOffloader(prefer="memory", min_offload_bytes=P, group_bytes=None,
                              min_ratio=0.0, sample_tensors=1, prefetch=0)
    _same(ref, _step(model, x, off))
    return model, x, ref, off


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_members_read_in_place_while_their_store_waits(gen):
    """Batches stored from their members where they lie, while their store is held up (the
    compress stream sleeps): the backward reads the members from the stash in place, before
    and after their store completes, and the gradients are bit-identical; once done, nothing
    is left in the stash or kept from it."""
    model, x, ref, off = _batching_bf16_model(gen)
    store = off._paged_store(x.device)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with torch.cuda.stream(store.compress_stream):
            torch.cuda._sleep(100_000_000)  # the compress waits: the members stay unread
        with off:
            loss = model(x)
        loss.backward()
        _same(ref, _grads(model))
    st = off.stats()
    assert st["batched_in_place"] > 0 and st["served_from_stash"] > 0, st
    off.synchronize()
    assert off.pending()["stash"] == 0
    assert all(e.parts is None and e.src is None for e in list(off._live)), "kept after use"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_members_go_once_compressed_while_their_pack_waits(gen, monkeypatch):
    """In a forward a compressed batch's members leave the stash once its pages are
    compressed, not once they are packed into host memory: with the pack stream asleep, the
    first batch stored is dropped from the GPU while its slice is still unplaced, and the
    backward, which then restores it, waits for the pack on the GPU: bit-identical
    gradients, nothing left in the stash."""
    from torch_pagecomp.offload._paged import PagedStored

    model, x, ref, off = _batching_bf16_model(gen)
    torch.cuda.synchronize()
    tracked = []
    track = ActivationOffloader._track

    def tracking(self, entry, src):
        tracked.append(entry)
        return track(self, entry, src)

    monkeypatch.setattr(ActivationOffloader, "_track", tracking)
    store = off._paged_store(x.device)
    model.zero_grad(set_to_none=True)
    with torch.cuda.stream(store.pack_stream):
        torch.cuda._sleep(400_000_000)  # ~0.2 s: the first slice's pack waits behind it (the
        # next slices' compress waits for that pack: one payload)
    with off:  # its batches are stored as it ends (no window: prefetch=0)
        loss = model(x)
    first = next(e for e in tracked if isinstance(e.stored, PagedStored))
    if first.stored.consumed is not None:
        first.stored.consumed.synchronize()  # compressed (not packed: the pack sleeps)
    with off._lock:
        off._poll()
    assert first not in off._stash and first.src is None and first.parts is None
    assert not first.ready(), "placed already: the sleep did not hold the pack"
    loss.backward()
    _same(ref, _grads(model))
    st = off.stats()
    assert st["batched"] > 0 and st.get("offload_failed", 0) == 0, st
    off.synchronize()
    assert off.pending()["stash"] == 0


def test_no_batch_is_stored_while_a_cuda_graph_is_captured(gen, monkeypatch):
    """A group that ends inside a graph capture (``offload_module``'s blocks in a captured
    forward) keeps its batch waiting: its launches and events must not go into the graph. The
    first flush after the capture stores it."""
    model, x, ref, off = _decided(gen)
    with off:
        loss = model(x)
        assert _waiting(off)
        monkeypatch.setattr(_batch, "_capturing", lambda: True)
        off.next_group()
        assert _waiting(off)  # still waiting
        monkeypatch.setattr(_batch, "_capturing", lambda: False)
    assert not _waiting(off)  # stored when the pass ended
    loss.backward()
    _same(ref, _grads(model))


@pytest.mark.parametrize("most", [1, 3])
def test_a_batch_holds_at_most_max_in_flight_tensors(gen, monkeypatch, most):
    """torchtune's ``max_fwd_stash_size`` (``max_in_flight_tensors``) bounds saved tensors, so
    a batch is stored once it holds that many (1: every storage alone)."""
    model, x = _model(gen, layers=4), _data(gen, 8, 1024)
    ref = _step(model, x)
    off = _off(max_in_flight_tensors=most)
    sizes = []
    real = off._batcher.flush

    def spy(batch):
        sizes.append(batch.members)
        real(batch)

    monkeypatch.setattr(off._batcher, "flush", spy)
    for _ in range(2):
        _same(ref, _step(model, x, off))
    assert sizes and max(sizes) <= most and (most == 1 or max(sizes) == most), sizes


def test_batched_entries_restore_again_for_a_second_backward(gen):
    """``retain_graph=True``: the end of the first backward drops every restored batch; the
    second restores them again, bit-identical."""
    model, x, ref, off = _decided(gen)
    with off:
        loss = model(x)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss.backward()
    _same(ref, first)
    _same(ref, _grads(model))
    assert off.stats()["batched"] > 0


def checkpointed_step(model, x, ctx) -> list[torch.Tensor]:
    """One step of ``model``'s layers each under non-reentrant checkpointing, the forward
    inside ``ctx``; the gradients."""
    from torch.utils.checkpoint import checkpoint

    model.zero_grad(set_to_none=True)
    with ctx:
        h = x
        for lin in model.layers:
            h = checkpoint(lambda t, lin=lin: torch.tanh(lin(t)) * t.sigmoid(), h,
                           use_reentrant=False)
        loss = h.float().square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_batches_under_activation_checkpointing(gen):
    """Non-reentrant checkpointing saves only each block's input under the hooks (its own
    hooks take the rest); those inputs batch and come back bit-identical."""
    model, x = _model(gen, layers=6), _data(gen, 16, 1024)
    ref = checkpointed_step(model, x, torch.enable_grad())
    off = _off()
    for _ in range(3):
        _same(ref, checkpointed_step(model, x, off))
    assert off.stats()["batched"] > 0
    assert off.pending()["entries"] == 0


def test_a_backward_on_another_thread_stores_the_waiting_batch(gen):
    """A backward run by another thread while the forward's pass is still open: its first
    unpack stores the waiting batch (under the offloader's lock), and gradients match."""
    import threading

    model, x, ref, off = _decided(gen)
    errors = []

    def backward(loss):
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    with off:
        loss = model(x)
        assert _waiting(off)
        worker = threading.Thread(target=backward, args=(loss,))
        worker.start()
        worker.join()
        assert not _waiting(off)
    assert not errors, errors
    _same(ref, _grads(model))


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))])
def test_a_batch_is_restored_member_by_member_each_freed_after_its_use(gen, monkeypatch,
                                                                        device):
    """A batch of several storages is restored member by member (``_entry._Member``): each
    member's buffer goes back once autograd has used its saved tensor, while the batch's
    other members are still to come; a member whose saved tensor was freed before the backward
    is not restored at all; gradients are bit-identical."""
    import weakref

    from torch_pagecomp.offload import _backward

    bufs: dict[int, weakref.ref] = {}
    real = _backward.Backward.restore

    def spy(self, entries):
        real(self, entries)
        for e in entries:
            for m in e.split_members() or ():
                if m.buf is not None:
                    bufs[m.base] = weakref.ref(m.buf)

    monkeypatch.setattr(_backward.Backward, "restore", spy)
    x = _data(gen, 8, 1024, device).requires_grad_()  # fp32 [8, 1024]: 8 pages, one class
    page8 = 8 * P
    seen = []

    def step(off):
        bufs.clear()
        with off:
            a = (x * 1.5).sin()  # saves x * 1.5: the batch's first member (byte 0)
            dropped = (x * 2.0).sin()  # saves x * 2: the second, freed before the backward
            v = a * 3.0
            w = v.cos()  # saves v: the third (byte 2 * page8)
        del dropped
        if isinstance(off, ActivationOffloader):  # stored by now: the backward restores
            off.synchronize()  # (on CUDA, else served from the stash while copies run)
        v.register_hook(lambda g: seen.append({b: r() is not None for b, r in bufs.items()}))
        x.grad = None
        w.sum().backward()
        return x.grad.clone()

    ref = step(torch.enable_grad())
    off = _off()
    step(off)  # samples and decides the class
    seen.clear()
    got = step(off)
    assert torch.equal(got, ref)
    assert off.stats()["batched"] >= 3
    assert set(bufs) == {0, 2 * page8}  # the dropped member was not restored
    # v's hook runs after cos's backward used (and released) v, before sin's uses x * 1.5
    assert seen == [{0: True, 2 * page8: False}]
    assert all(r() is None for r in bufs.values())  # all freed by the end
