"""``PageCompressor``'s one-call path for small 16-bit float tensors (``_small_tensor``, #26).

It must give what the general path gives (the same stored bytes, handle, counts and errors)
on the cases it takes, and leave every other case to the general path. On the CPU the
kernel-only path runs with the Triton interpreter (the ``direct`` fixture of
``conftest.py``); the general path is reached with ``element_size=2``, which the one-call
path never takes. Outputs are poisoned before every restore.
"""

from __future__ import annotations

import pytest
import torch
from test_direct import _floats

from torch_pagecomp import _direct, _small_tensor
from torch_pagecomp.format import CorruptPageError, PageCompError
from torch_pagecomp.pipeline import PipelineStopped


@pytest.fixture
def taken(monkeypatch):
    """Counts the calls the one-call path took (``offload`` / ``restore`` not None)."""
    counts = {"offload": 0, "restore": 0}
    cls = _small_tensor.SmallTensorPath
    for name in counts:
        orig = getattr(cls, name)

        def wrapped(self, *a, _orig=orig, _name=name):
            got = _orig(self, *a)
            counts[_name] += got is not None
            return got

        monkeypatch.setattr(cls, name, wrapped)
    return counts


def _warm(pc, taken=None):
    """The first small offload goes the general way and makes the kernel-only path (the
    counts of ``taken`` zeroed after)."""
    pc.restore(pc.offload(torch.zeros(8, dtype=torch.bfloat16, device=pc.device))).sum()
    assert pc._small_tensor is not None
    if taken is not None:
        taken.update(offload=0, restore=0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(), (1,), (100,), (3, 2048), (2, 3, 1365), (4 * 2048,)])
def test_same_bytes_handle_and_counts_as_the_general_path(direct, gen, taken, dtype, shape):
    pc = direct(codec="exp")
    _warm(pc, taken)
    x = _floats(gen, max(1, torch.Size(shape).numel()), dtype).reshape(shape)
    before = dict(pc.counts)
    fast = pc.offload(x)
    assert taken["offload"] == 1
    general = pc.offload(x, element_size=2)
    assert taken["offload"] == 1
    assert type(fast._storage) is type(general._storage) is _direct.SmallStorage
    for attr in ("shape", "dtype", "nbytes", "page_size", "element_size", "codec",
                 "stored_nbytes"):
        assert getattr(fast, attr) == getattr(general, attr), attr
    assert fast.kernel_bytes() == general.kernel_bytes()
    cf, cg = fast.compressed(), general.compressed()
    assert torch.equal(cf.payload, cg.payload) and torch.equal(cf.sizes, cg.sizes)
    assert torch.equal(cf.kinds, cg.kinds)
    out = torch.full_like(x, 7)
    got = pc.restore(fast, out=out)
    assert got is out and taken["restore"] == 1
    assert torch.equal(_bits(out), _bits(x))
    new = pc.restore(general)
    assert taken["restore"] == 2 and new.shape == x.shape and new.dtype == dtype
    assert torch.equal(_bits(new), _bits(x))
    assert pc.counts["offloads"] - before["offloads"] == 2
    assert pc.counts["restores"] - before["restores"] == 2
    assert pc.counts["bytes_in"] - before["bytes_in"] == 2 * x.nbytes
    assert pc.stats()["direct"]["offloads"] == 3
    fast.free()
    general.free()
    assert pc.stats()["direct"]["small_host_used_bytes"] == 0


def test_other_cases_go_the_general_way(direct, gen, taken):
    """Non-contiguous, negated views, subclasses, other dtypes, larger than a batch, and a
    tensor requiring grad (taken: its bits, no graph) all come back exact."""
    pc = direct(codec="exp")
    _warm(pc, taken)
    base = _floats(gen, 4 * 2048, torch.bfloat16)
    cases = {
        "strided": (base.view(64, 128).t(), False),
        "neg view": (torch._neg_view(base[:300]), False),
        "parameter": (torch.nn.Parameter(base[:500].clone()), False),
        "fp32": (torch.randn(300, generator=gen), False),
        "past a batch": (_floats(gen, 4 * 2048 + 1, torch.bfloat16), False),
        "requires grad": (base[:700].clone().requires_grad_(), True),
    }
    for name, (t, fast) in cases.items():
        before = taken["offload"]
        h = pc.offload(t)
        assert taken["offload"] - before == int(fast), name
        got = pc.restore(h, out=torch.full(t.shape, 3, dtype=t.dtype))
        assert torch.equal(got.detach(), t.detach()), name
        assert not got.requires_grad
        h.free()


def test_restore_refusals_are_the_general_paths(direct, gen, taken):
    """A freed handle, a wrong out, a handle of another compressor: the general path's
    errors, or its result; check=True and device="cpu" go the general way."""
    pc, other = direct(codec="exp"), direct(codec="exp", page_size=8192)
    _warm(pc, taken)
    _warm(other)
    x = _floats(gen, 3000, torch.bfloat16)
    h = pc.offload(x)
    for bad in (torch.empty(3001, dtype=torch.bfloat16), torch.empty(3000, dtype=torch.float16),
                torch.empty(6000, dtype=torch.bfloat16)[::2]):
        with pytest.raises(PageCompError, match="out must be"):
            pc.restore(h, out=bad)
    assert torch.equal(_bits(pc.restore(h, check=True)), _bits(x))
    assert torch.equal(_bits(pc.restore(h, device="cpu")), _bits(x))
    with pytest.raises(PageCompError, match="page_size"):
        other.restore(h)
    n = taken["restore"]
    h.free()
    with pytest.raises(PageCompError, match="freed"):
        pc.restore(h)
    assert taken["restore"] == n


def test_corrupt_pages_raise_on_the_cpu(direct, gen):
    """On the CPU every restore checks, the one-call path's too."""
    pc = direct(codec="exp")
    _warm(pc)
    x = _floats(gen, 4 * 2048, torch.bfloat16)
    h = pc.offload(x)
    _, sizes, _, _ = h._storage.stored.views()
    sizes[2] = 4096 + 16
    before = pc.counts["restores"]
    with pytest.raises(CorruptPageError) as exc:
        pc.restore(h)
    assert exc.value.pages == [2]
    assert pc.counts["restores"] == before + 1  # counted as the general path counts it
    with pytest.raises(CorruptPageError):
        pc.restore(h, check=True)  # (the general path)
    assert pc.counts["restores"] == before + 2


def test_a_meta_tensor_is_refused_by_name(direct):
    """A meta tensor (no data) gets the general path's error, and no block is taken."""
    pc = direct(codec="exp")
    _warm(pc)
    used = pc._direct.small.arena.stats()["used_bytes"]
    with pytest.raises(PageCompError, match="meta"):
        pc.offload(torch.empty(300, dtype=torch.bfloat16, device="meta"))
    assert pc._direct.small.arena.stats()["used_bytes"] == used


def test_closed_compressor_refuses_offload_and_still_restores(direct, gen, taken):
    pc = direct(codec="exp")
    _warm(pc, taken)
    x = _floats(gen, 2048, torch.float16)
    h = pc.offload(x)
    pc.close()
    with pytest.raises(PipelineStopped):
        pc.offload(x)
    assert torch.equal(_bits(pc.restore(h)), _bits(x))
    assert taken == {"offload": 1, "restore": 1}


def test_small_bytes_zero_sends_everything_to_the_arena_store(direct, gen, monkeypatch):
    """``_direct.SMALL_BYTES`` read when the path is made (a probe's switch): 0, none taken."""
    monkeypatch.setattr(_direct, "SMALL_BYTES", 0)
    pc = direct(codec="exp")
    _warm(pc)
    h = pc.offload(_floats(gen, 100, torch.bfloat16))
    assert type(h._storage) is _direct.DirectStorage


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_same_bytes_as_the_general_path_behind_busy_streams(gen, taken, dtype):
    """On a GPU, behind queued work on both sides: the one-call path stores what the general
    path stores and restores exactly into new and poisoned tensors; a corrupted page is
    counted by ``failed_restores``."""
    from torch_pagecomp.module import PageCompressor

    with PageCompressor(batch_pages=2048) as pc:
        _warm(pc, taken)
        for shape in ((1,), (3, 700), (2048,), (64, 4096 + 3), (1 << 20,)):
            want = _floats(gen, torch.Size(shape).numel(), dtype).reshape(shape).cuda()
            x = torch.zeros_like(want)
            torch.cuda._sleep(20_000_000)
            x.copy_(want)
            fast, general = pc.offload(x), pc.offload(x, element_size=2)
            torch.cuda._sleep(20_000_000)
            new = pc.restore(fast)
            out = pc.restore(general, out=torch.full_like(want, 3.0))
            assert torch.equal(_bits(new), _bits(want)) and torch.equal(_bits(out), _bits(want))
            cf, cg = fast.compressed(), general.compressed()
            assert torch.equal(cf.payload, cg.payload) and torch.equal(cf.sizes, cg.sizes)
            fast.free()
            general.free()
        assert taken == {"offload": 5, "restore": 10}
        assert pc.failed_restores(wait=True) == 0
        h = pc.offload(_floats(gen, 4 * 2048, dtype).cuda())
        h.wait()
        _, sizes, _, _ = h._storage.stored.views()
        sizes[1] = 4096 + 16
        pc.restore(h)
        assert pc.failed_restores(wait=True) == 1
        h.free()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_free_waits_for_the_restores_on_every_stream(gen):
    """Restored on two streams, the first held back, then freed and its block's place taken
    by new offloads: both restores come back exact (the block went back only after both)."""
    from torch_pagecomp.module import PageCompressor

    with PageCompressor(batch_pages=2048) as pc:
        want = _floats(gen, 1 << 18, torch.bfloat16).cuda()
        h = pc.offload(want)
        h.wait()
        slow, quick = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(slow):
            torch.cuda._sleep(200_000_000)
            a = pc.restore(h)
        with torch.cuda.stream(quick):
            b = pc.restore(h)
        quick.synchronize()
        h.free()
        others = [pc.offload(_floats(gen, 1 << 18, torch.bfloat16).cuda()) for _ in range(4)]
        for o in others:
            o.wait()
        slow.synchronize()
        assert torch.equal(_bits(a), _bits(want)) and torch.equal(_bits(b), _bits(want))
        assert pc.failed_restores(wait=True) == 0
