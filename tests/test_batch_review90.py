"""Review 90: the store scheduling side of the activation offload hooks (``offload._batch``,
the hooks' pass, store and stash book-keeping) on the CPU path: graphs dropped without a
backward, an interrupt while a pass ends, the failure counters, and the tuner's releases.
Gradients are compared bit for bit against the same step without offload, on fresh random
data."""

from __future__ import annotations

import gc
import weakref

import offload_cases
import pytest
import torch
from offload_cases import MODES

from torch_pagecomp.offload import ActivationOffloader
from torch_pagecomp.offload._entry import _Entry, _Pass
from torch_pagecomp.offload._stores import CpuStore

pytestmark = pytest.mark.usefixtures("quiet")


def cpu_off(mode: str, **kw):
    """:func:`offload_cases.cpu_off` keeping tensors under 4 KiB (``forward``'s ``exp``)."""
    kw.setdefault("min_offload_bytes", 4096)
    return offload_cases.cpu_off(mode, **kw)


def forward(w: torch.Tensor, x: torch.Tensor, off=None, blocks: int = 4):
    """``(loss, a kept output)``: each block saves its 8 KiB input and product (offloaded,
    with ``x`` of 32 x 64 fp32), and ``exp`` saves its own output, 1 KiB (kept: small)."""
    h, small = x, None
    for _ in range(blocks):
        if off is not None:
            off.next_group()
        h = (h @ w).sin()
        small = h[:4].exp()  # a node's output saved by that node, kept where it is
        h = h * small.mean()
    return h.square().sum(), small


def grad_of(w, x, off=None):
    w.grad = None
    if off is None:
        forward(w, x)[0].backward()
    else:
        with off:
            loss = forward(w, x, off)[0]
        loss.backward()
    grad, w.grad = w.grad, None
    return grad


# ------------------------------------------------------- graphs dropped without a backward
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("how", ["dropped", "raised"])
def test_a_graph_dropped_without_a_backward_frees_all_it_saved(gen, mode, prefetch, how):
    """A graph dropped without a backward (an evaluation under grad, a forward that raised):
    its saved tensors, offloaded or held, and the offloader's entries go with it. The pack
    hook handed autograd a kept tensor as it was: a node's own saved output then held the
    node through its grad_fn, a cycle through C++ that no collector breaks, and the whole
    graph stayed (its host copies, the storages held for the backward) for the process's
    life."""
    w = torch.randn(64, 64, generator=gen).mul(0.1).requires_grad_()
    off = cpu_off(mode, prefetch=prefetch)
    for _ in range(2):  # (the first decides the classes: the second batches)
        x = torch.randn(32, 64, generator=gen)
        if how == "dropped":
            with off:
                loss, small = forward(w, x, off)
        else:
            with pytest.raises(RuntimeError, match="boom"), off:
                loss, small = forward(w, x, off)
                raise RuntimeError("boom")
        assert off.stats()["offloaded_bytes"] > 0 or off.pending()["holding"] > 0
        kept = weakref.ref(small)
        del loss, small
        gc.collect()
        assert kept() is None  # the graph is gone
        pending = off.pending()
        assert pending["entries"] == 0 and pending["holding"] == 0, pending
        assert pending["host_bytes"] == 0, pending
    with off:  # a new pass: nothing earlier is left to store
        pass
    assert off._batcher.members == 0 and not off._batcher.held
    x = torch.randn(32, 64, generator=gen)
    assert torch.equal(grad_of(w, x, off), grad_of(w, x))
    assert off.pending()["entries"] == 0


# ------------------------------------------------------------ an interrupt as a pass ends
def test_an_interrupt_while_a_pass_ends_takes_the_hooks_off(gen, monkeypatch):
    """Ctrl-C in the store of the batch the pass's end flushes (``prefetch=0``): the hooks
    come off all the same. Left on, every tensor this thread saved afterwards, outside any
    ``with``, was packed into the pass that had ended. The batch interrupted keeps its
    members in place: its graph's backward reads them there, nothing lost."""
    w = torch.randn(64, 64, generator=gen).mul(0.1).requires_grad_()
    off = cpu_off("compressed", prefetch=0)
    x = torch.randn(32, 64, generator=gen)
    assert torch.equal(grad_of(w, x, off), grad_of(w, x))  # the classes are decided
    real, armed = CpuStore.offload, []

    def interrupted(self, *a):
        if armed:
            armed.clear()
            raise KeyboardInterrupt
        return real(self, *a)

    monkeypatch.setattr(CpuStore, "offload", interrupted)
    x = torch.randn(32, 64, generator=gen)
    with pytest.raises(KeyboardInterrupt), off:
        loss = forward(w, x, off)[0]
        assert off._batcher.open  # the last group's batch: stored as the pass ends
        armed.append(1)
    assert not armed and off._pass is None
    packed = off.stats()["packed"]
    forward(w, torch.randn(32, 64, generator=gen))[0].backward()  # outside: no hooks
    assert off.stats()["packed"] == packed
    w.grad = None
    loss.backward()
    assert torch.equal(w.grad, grad_of(w, x))
    x = torch.randn(32, 64, generator=gen)
    assert torch.equal(grad_of(w, x, off), grad_of(w, x))
    del loss
    gc.collect()
    assert off.pending()["entries"] == 0 and off.pending()["holding"] == 0


# ---------------------------------------------------------------------- counters, releases
def test_a_failed_store_found_at_its_release_counts_each_member():
    """A batch's store that fails after it started (on a GPU: a slice not placed, seen when
    the stash lets it go, ``_release``) counts ``offload_failed`` per saved storage, as a
    store that raises does (``Batcher.flush``), not once per batch."""
    off = cpu_off("compressed")
    entry = _Entry(off._sink, 3 * 4096, torch.device("cpu"), _Pass(), 0)
    entry.members, entry.error = 3, RuntimeError("slice not placed")
    entry.parts = [(k * 4096, torch.zeros(4096, dtype=torch.uint8)) for k in range(3)]
    off._stash.append(entry)
    off._stash_bytes, off._stash_tensors = entry.nbytes, entry.members
    off._release(off._stash.popleft(), wait=True)
    assert off.counters["offload_failed"] == 3
    assert off._stash_bytes == 0 and off._stash_tensors == 0
    assert entry in off._failed and entry.parts is not None  # kept: served from its parts


class _SettledTuner:
    """A speed tuner already settled on ``choice`` and checked."""

    checking = False

    def __init__(self, choice: str):
        self.choice = choice

    def start_pass(self, grew: bool = False) -> str:
        return self.choice

    def add_bytes(self, nbytes: int) -> None:
        pass

    def summary(self) -> dict:
        return {"choice": self.choice}


def test_a_tuned_release_that_raised_is_tried_again_at_the_next_pass(monkeypatch):
    """Settled on compressing, a pass's start gives the plain copies' idle page-locked
    memory back (``_tuned_arm``). A release that raised was marked done first, and never
    tried again: the memory stayed pinned for the offloader's life."""
    off = ActivationOffloader(offload_cpu=True, prefer="speed", tuner=_SettledTuner("compress"))
    calls = []

    def clear():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unpin failed")

    monkeypatch.setattr(off.pool, "clear", clear)
    with pytest.raises(RuntimeError, match="unpin failed"), off:
        pass
    with off:
        pass
    with off:
        pass
    assert len(calls) == 2  # tried again once, then done


class _FailedLate:
    """A stored tensor whose store failed after it started (a GPU slice not placed): its
    source is read, the failure is seen at the stash's poll."""

    kind = "compressed"

    def source_read(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def failed(self) -> bool:
        return True

    def free(self, stored) -> None:
        pass


def test_stats_counts_a_failure_its_own_poll_found():
    """``stats()`` polls the stash (``pending()``): a store found failed there is in its
    ``failed`` and in its ``offload_failed`` alike (the counters were copied before the
    poll, so one call said one failed entry and no failed offload)."""
    off = cpu_off("compressed")
    entry = _Entry(off._sink, 4096, torch.device("cpu"), _Pass(), 0)
    entry.store = entry.stored = _FailedLate()
    entry.src = torch.zeros(4096, dtype=torch.uint8)
    off._stash.append(entry)
    off._stash_bytes, off._stash_tensors = entry.nbytes, entry.members
    st = off.stats()
    assert st["failed"] == 1 and st["stash"] == 0
    assert st.get("offload_failed", 0) == 1, st
