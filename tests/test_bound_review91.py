"""Review 91: the activation offloader's in-flight bounds (``ActivationOffloader._bound``) over
the stash and the held batches (``offload._batch``): ``max_in_flight_tensors`` is one count of
the two, and a held batch whose saved tensors were all freed stops counting.

The stash is CUDA's; the CPU tests give CPU stores one (``_gpu_like_stash``: a store's source
stays in the stash, unread, until the bound waits for it), so the bound's loop runs as on a
GPU. The GPU tests run the real stash. Every run draws fresh weights and inputs; gradients are
compared bit for bit against the same step without offload.
"""

from __future__ import annotations

import pytest
import torch
from offload_cases import MODES

from tests.test_offload_batch import P, _data, _same, _step
from tests.test_offload_hold import ROWS, WIDTH, _model, _off
from torch_pagecomp.offload import ActivationOffloader
from torch_pagecomp.offload._entry import _Entry
from torch_pagecomp.offload._stores import CpuStored

pytestmark = pytest.mark.usefixtures("quiet")
CUDA = torch.cuda.is_available()


def _gpu_like_stash(monkeypatch) -> None:
    """CPU stores tracked as a GPU's are (``_track``): each entry's source stays in the stash
    until its store has read it, which here is when the bound waits for it (``wait_on``);
    the stash's poll lets nothing go before."""
    track = ActivationOffloader._track

    def tracked(self, entry, src):
        track(self, entry, src)
        if entry.device.type == "cpu":
            self._stash_add(entry, src)

    monkeypatch.setattr(ActivationOffloader, "_track", tracked)
    monkeypatch.setattr(CpuStored, "source_read", lambda self: getattr(self, "read", False),
                        raising=False)
    monkeypatch.setattr(CpuStored, "wait_on", lambda self, stream: setattr(self, "read", True))


def _counted(off) -> list[int]:
    """The saved tensors in flight (stashed and held) after each outermost ``_bound``."""
    seen, real = [], off._bound

    def bound():
        outermost = not off._bounding
        real()
        if outermost:
            seen.append(off._stash_tensors + off._batcher.members)

    off._bound = bound
    return seen


class _Unread:
    """A stored entry whose store reads its source only once waited for (``wait_on``)."""

    kind = "compressed"

    def __init__(self):
        self.read = False

    def source_read(self) -> bool:
        return self.read

    def ready(self) -> bool:
        return self.read

    def wait_on(self, stream) -> None:
        self.read = True

    def free(self, stored) -> None:
        pass


# ------------------------------------------------------------- one count: stash and held
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("most", [2, 4])
def test_stashed_and_held_storages_are_one_count(gen, monkeypatch, mode, most):
    """``max_in_flight_tensors`` bounds the saved tensors whose offload is unfinished, those in
    the stash and those held together: after every bound at most ``most``. The stash and the
    held batches were bounded each on its own (the stash past ``most``, the held at
    ``most``), so up to ``2 * most - 1`` were in flight."""
    _gpu_like_stash(monkeypatch)
    model, x = _model(gen), _data(gen, ROWS, WIDTH)
    ref = _step(model, x)
    off = _off(mode=mode, max_in_flight_tensors=most)
    seen = _counted(off)
    for _ in range(2):  # (the first decides the classes: the second batches)
        _same(ref, _step(model, x, off))
        assert off.pending()["stash"] == 0 and off.pending()["entries"] == 0
    assert len(seen) > 10 and max(seen) <= most, seen
    st = off.stats()
    assert st["in_flight_waits"] > 0 and st["offloaded_bytes"] > 0, st
    assert st.get("offload_failed", 0) == 0, st


def test_a_batch_alone_in_the_stash_past_the_count_is_waited_for_once_older(gen, monkeypatch):
    """The newest stashed entry is never waited for: a batch of more saved tensors than the
    bound (set up here, as a storage past ``max_in_flight_bytes`` is for the bytes), the only
    entry in the stash, stays. A held storage past the count is stored, into
    the stash, which makes the batch older: it is waited for, and the loop ends within the
    bound. Bounded on its own, the stash was left over the bound and the held storage held."""
    _gpu_like_stash(monkeypatch)
    w = torch.randn(ROWS, WIDTH, generator=gen).requires_grad_()
    off = _off(max_in_flight_tensors=2)
    big = _Entry(off._sink, 5 * P, torch.device("cpu"), None, 0)
    big.members = 5
    big.store = big.stored = _Unread()
    big.src = torch.zeros(5 * P, dtype=torch.uint8)
    off._stash.append(big)
    off._stash_bytes, off._stash_tensors = big.nbytes, big.members
    with off:
        seen = _counted(off)
        y = (w + 1).sin()  # saves its input: held, then stored as the count is past 2
        assert big.stored.read and big not in off._stash
        assert seen and max(seen) <= 2, seen
        assert off.counters["in_flight_waits"] == 1
    y.sum().backward()
    assert torch.equal(w.grad, (w.detach() + 1).cos())
    assert off.pending()["stash"] == 0 and off.pending()["entries"] == 0


# ------------------------------------------------------------------ freed held batches
def _forward_dropping_two(w: torch.Tensor):
    """``(first, second)``: two outputs of ``sin`` (each saves its input, held in a batch
    of its own: its class is not yet decided), and between them two more whose graphs are
    dropped at once (an evaluation under grad): their saved inputs are freed."""
    first = (w + 1).sin()
    for k in (2, 3):
        dropped = (w + k).sin()
        del dropped
    second = (w + 4).sin()
    return first, second


@pytest.mark.parametrize("mode", MODES)
def test_freed_held_batches_stop_counting_against_max_in_flight_tensors(gen, mode):
    """Two held storages alive and two freed, under ``max_in_flight_tensors=3``: the freed
    ones' batches are taken off the books, so nothing is stored and both live ones are read
    in place. Counted until they were due, the freed batches made the bound store the oldest
    live one (a store, its host memory and a restore, for nothing)."""
    w = torch.randn(ROWS, WIDTH, generator=gen).requires_grad_()
    off = _off(mode=mode, max_in_flight_tensors=3, group_bytes=None)
    with off:
        first, second = _forward_dropping_two(w)
        assert off._batcher.members == off.pending()["holding"] == 2
        assert off.stats().get("offloaded_bytes", 0) == 0
    (first.sum() + second.sum()).backward()
    assert torch.equal(w.grad, (w.detach() + 1).cos() + (w.detach() + 4).cos())
    st = off.stats()
    assert st["served_held"] == 2 and st.get("offloaded_bytes", 0) == 0, st
    assert st["entries"] == 0 and st["holding"] == 0 and not off._batcher.members


def test_a_freed_batch_is_taken_off_once_and_only_once_freed(gen):
    """``Batcher.prune``: nothing to scan until an entry of a held batch is freed; then its
    batch, and only it, leaves the books (its members and the held deque), once."""
    w = torch.randn(ROWS, WIDTH, generator=gen).requires_grad_()
    off = _off(group_bytes=None)
    batcher = off._batcher
    with off:
        first = (w + 1).sin()
        dropped = (w + 2).sin()
        assert batcher.members == 2 and not batcher._freed
        batcher.prune()
        assert batcher.members == 2
        del dropped
        assert len(batcher._freed) == 1 and batcher.members == 2
        batcher.prune()
        assert batcher.members == 1 and not batcher._freed
        assert len(batcher.held) == 1 and batcher.held[0].ref() is not None
        batcher.prune()
        assert batcher.members == 1
    first.sum().backward()
    assert torch.equal(w.grad, (w.detach() + 1).cos())


# ------------------------------------------------------------------------------ on a GPU
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", MODES)
def test_gpu_freed_held_batches_stop_counting_against_max_in_flight_bytes(gen, mode):
    """On CUDA, held bytes count against ``max_in_flight_bytes``: with two held storages alive
    and two freed, under a bound of two and a half storages, nothing is stored (the freed
    batches' bytes went with their entries) and both are read in place."""
    w = torch.randn(ROWS, WIDTH, generator=gen).cuda().requires_grad_()
    nbytes = w.numel() * w.element_size()
    off = ActivationOffloader(mode=mode, prefer="memory", min_offload_bytes=P, group_bytes=None,
                              min_ratio=0.0, sample_tensors=1,
                              max_in_flight_bytes=2 * nbytes + nbytes // 2)
    with off:
        first, second = _forward_dropping_two(w)
        assert off._batcher.nbytes == 2 * nbytes and off.pending()["holding"] == 2
        assert off.stats().get("offloaded_bytes", 0) == 0
    (first.sum() + second.sum()).backward()
    assert torch.equal(w.grad, (w.detach() + 1).cos() + (w.detach() + 4).cos())
    st = off.stats()
    assert st["served_held"] == 2 and st.get("offloaded_bytes", 0) == 0, st
    torch.cuda.synchronize()
    assert off.pending()["entries"] == 0 and not off._batcher.nbytes


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("most", [2, 4])
def test_gpu_stashed_and_held_storages_are_one_count(gen, monkeypatch, mode, most):
    """On CUDA, every store's source kept in the stash through the forward (its store not
    read until the bound waits for it): after every bound at most ``most`` saved tensors are
    stashed and held together; the gradients are bit-identical."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(gen, layers=6, device="cuda", dtype=torch.bfloat16)
    x = _data(gen, 512, WIDTH, "cuda", torch.bfloat16)
    ref = _step(model, x)
    off = ActivationOffloader(mode=mode, prefer="memory", min_offload_bytes=P,
                              group_bytes=512 * WIDTH * 2, min_ratio=0.0, sample_tensors=1,
                              max_in_flight_tensors=most)
    in_flight = [False]
    real = _Entry.source_read
    monkeypatch.setattr(_Entry, "source_read",
                        lambda self: not in_flight[0] and real(self))
    seen = _counted(off)
    for _ in range(2):  # (the first decides the classes: the second batches)
        model.zero_grad(set_to_none=True)
        in_flight[0] = True  # read only once waited for: the stash keeps every source
        with off:
            loss = model(x)
        in_flight[0] = False
        loss.backward()
        del loss
        _same(ref, [p.grad for p in model.parameters()])
    assert len(seen) > 10 and max(seen) <= most, seen
    st = off.stats()
    assert st["in_flight_waits"] > 0 and st["offloaded_bytes"] > 0, st
    assert st.get("offload_failed", 0) == 0, st
    torch.cuda.synchronize()
    assert off.pending()["stash"] == 0 and off.pending()["entries"] == 0
