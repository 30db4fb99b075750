"""Review 90: the restore side of the activation offload hooks (``offload._backward``) on the
CPU path: restores of passes whose forwards were interleaved, the restore counters, and a
restore failure whose buffer no backward read. Gradients are compared bit for bit against the
same step without offload, on fresh random data."""

from __future__ import annotations

import collections

import pytest
import torch
from offload_cases import MODES, cpu_off

from torch_pagecomp.offload._stores import CpuStore

pytestmark = pytest.mark.usefixtures("quiet")


def chain(w: torch.Tensor, x: torch.Tensor, off=None, blocks: int = 5):
    """``blocks`` groups, each saving its input and its product (offloaded; ``w`` is kept):
    ``(loss, each block's output)``."""
    hs, h = [], x
    for _ in range(blocks):
        if off is not None:
            off.next_group()
        h = (h @ w).sin()
        hs.append(h)
    return h.square().sum(), hs


def reference(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w.grad = None
    chain(w, x)[0].backward()
    grad, w.grad = w.grad, None
    return grad


def spy_restores(monkeypatch) -> tuple[list, dict]:
    """Every store restore the hooks run to its end, as the stored object's id; and a switch:
    ``stop["at"] = n`` raises ``KeyboardInterrupt`` in the ``n``-th restore from then on."""
    calls, stop, real = [], {"at": None}, CpuStore.restore

    def restore(self, stored, out):
        if stop["at"] is not None:
            stop["at"] -= 1
            if stop["at"] == 0:
                stop["at"] = None
                raise KeyboardInterrupt
        real(self, stored, out)
        calls.append(id(stored))

    monkeypatch.setattr(CpuStore, "restore", restore)
    return calls, stop


def restores_counted(off) -> int:
    st = off.stats()
    return st.get("restored_prefetch", 0) + st.get("restored_on_demand", 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [1, 2])
def test_interleaved_forwards_restore_only_the_pass_whose_backward_runs(mode, prefetch,
                                                                        monkeypatch):
    """Forwards of three micro-batches, then their backwards in the same order (a pipeline's
    schedule). The first unpack of each backward prefetched the tail of the *latest* forward:
    during B's backward the last groups of C (stored when A's backward ended) were brought
    back, held through B's backward, dropped at its end and brought back again for C's: GPU
    memory and link bytes for nothing. Each stored tensor must be restored once, by its own
    pass's backward."""
    w = torch.randn(64, 64, requires_grad=True)
    xs = [torch.randn(64, 64) for _ in range(3)]
    refs = [reference(w, x) for x in xs]
    off = cpu_off(mode, prefetch=prefetch)
    passes, losses = [], []
    for x in xs:
        with off:
            losses.append(chain(w, x, off)[0])
            passes.append(off._pass)
    entries = sum(len(g) for ps in passes for g in ps.groups)  # each stored before its backward
    running, seen = [None], []
    real = off._backward.restore

    def restore(entries, *args, **kw):
        seen.extend((e.pass_ is running[0], id(e)) for e in entries)
        return real(entries, *args, **kw)

    monkeypatch.setattr(off._backward, "restore", restore)
    for ps, loss, ref in zip(passes, losses, refs):
        running[0] = ps
        w.grad = None
        loss.backward()
        assert torch.equal(w.grad, ref)
    del passes, losses
    assert all(own for own, _ in seen), "a backward restored another pass's tensors"
    # each once (alive from the forwards to their backward: no id is reused among them)
    assert len({i for _, i in seen}) == len(seen) == entries
    assert not any(off.pending().values()), off.pending()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["partial", "interleaved", "synchronized", "interrupted"])
def test_restore_counters_count_each_restore_once(mode, how, monkeypatch):
    """``restored_prefetch + restored_on_demand`` is the number of restores run. A tensor
    restored with its group by its own unpack was counted as neither (a backward that starts
    below the pass's last groups, or another pass's backward than the latest forward's), and
    a prefetch stopped midway (an interrupt) counted the restores it had not run, counted
    again when the retried backward ran them."""
    calls, stop = spy_restores(monkeypatch)
    w = torch.randn(64, 64, requires_grad=True)
    x, x2 = torch.randn(64, 64), torch.randn(64, 64)
    ref = reference(w, x)
    off = cpu_off(mode, prefetch=1)
    with off:
        loss, hs = chain(w, x, off)
    if how == "partial":  # a backward from the middle block's output on
        want = torch.autograd.grad(chain(w, x)[1][2].sum(), w)[0]
        assert torch.equal(torch.autograd.grad(hs[2].sum(), w, retain_graph=True)[0], want)
    elif how == "interleaved":  # another forward after it, then this one's backward first
        with off:
            other = chain(w, x2, off)[0]
    elif how == "synchronized":  # every group stored: the backward's first unpack restores
        off.synchronize()
    else:  # the first prefetch stopped at its second restore, the backward retried
        off.synchronize()
        stop["at"] = 2
        with pytest.raises(KeyboardInterrupt):
            loss.backward(retain_graph=True)
    w.grad = None
    loss.backward()
    assert torch.equal(w.grad, ref)
    if how == "interleaved":
        del other
    assert calls and restores_counted(off) == len(calls), (off.stats(), len(calls))
    del loss, hs
    assert not any(off.pending().values()), off.pending()


def _flaky_restores(monkeypatch):
    """``(w, x, the reference gradient, fail)``: ``CpuStore.restore`` raises an out-of-memory
    error while ``fail[0]`` counts down from what the test sets."""
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)
    ref = reference(w, x)
    real, fail = CpuStore.restore, [0]

    def flaky(self, stored, out):
        if fail[0]:
            fail[0] -= 1
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, stored, out)

    monkeypatch.setattr(CpuStore, "restore", flaky)
    return w, x, ref, fail


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_restore_no_backward_read_does_not_fail_the_next_backward(mode, monkeypatch):
    """A prefetch's restore fails once (out of memory) for a tensor this backward never reads
    (``autograd.grad`` of a middle block's output stops above it). Its error was kept past the
    backward's end: the next backward of the retained graph restored the tensor fine, then
    raised the old error at its unpack (a spurious failure). A restore's error belongs to that
    restore: one that ran again since says nothing."""
    w, x, ref, fail = _flaky_restores(monkeypatch)
    off = cpu_off(mode, prefetch=1)
    with off:
        loss, hs = chain(w, x, off)
    fail[0] = 1  # block 3's unpack prefetches block 2's tensors, which this grad never reads
    torch.autograd.grad(loss, hs[2], retain_graph=True)
    assert fail[0] == 0  # it did fail
    loss.backward()
    assert torch.equal(w.grad, ref)
    del loss, hs
    assert not any(off.pending().values()), off.pending()


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_restore_read_by_its_unpack_still_raises_once(mode, monkeypatch):
    """The control of the test above: a restore that fails for a tensor the backward reads
    raises naming it, and the retried backward (the graph retained) restores it again."""
    w, x, ref, fail = _flaky_restores(monkeypatch)
    off = cpu_off(mode, prefetch=1)
    with off:
        loss, _ = chain(w, x, off)
    fail[0] = 1
    with pytest.raises(RuntimeError, match="activation restore failed: CUDA out of memory"):
        loss.backward(retain_graph=True)
    w.grad = None
    loss.backward()
    assert torch.equal(w.grad, ref)
    del loss
    assert not any(off.pending().values()), off.pending()
    assert collections.Counter(off.stats())["offload_failed"] == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes", [(64, 64), (64, 1024)], ids=["one", "members"])
def test_another_backwards_end_while_an_unpack_reads_its_restore(mode, sizes, monkeypatch):
    """Backwards may run on several threads at once, and the end of each drops every
    restored buffer (``Backward._end_backward``). An unpack read its entry's restore (the
    buffer, a batch member's, the restore's event) after letting the offloader's lock go: a
    backward ending on another thread right then left it None, and the unpack raised
    (``'NoneType' object has no attribute 'untyped_storage'``, or a member "not restored
    (internal error)"). The other thread's end now waits for the unpack."""
    import threading

    from torch_pagecomp.offload._entry import SPLIT, _Entry

    w = torch.randn(sizes[1], sizes[1], requires_grad=True)
    x = torch.randn(*sizes)
    ref = reference(w, x)
    off = cpu_off(mode, prefetch=0, sample_tensors=1)
    with off:  # samples the class (the second pass batches its storages)
        chain(w, x, off)[0].backward()
    w.grad = None
    with off:
        loss, _ = chain(w, x, off)
    real, ended, split = _Entry.check_restored, [], []

    def check_restored(self):
        if not ended:  # the first unpack: another backward ends meanwhile
            split.append(self.restored is SPLIT)
            other = threading.Thread(target=off._backward._end_backward, args=(-2,))
            other.start()
            other.join(0.5)  # (held back until the unpack is done, if it waits for it)
            ended.append(other)
        return real(self)

    monkeypatch.setattr(_Entry, "check_restored", check_restored)
    loss.backward()
    ended[0].join()
    assert torch.equal(w.grad, ref)
    if mode == "compressed" and sizes[1] == 1024:  # a batch restored member by member
        assert off.stats()["batched"] > 0 and split == [True]
    del loss
    assert not any(off.pending().values()), off.pending()
