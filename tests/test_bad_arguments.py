"""Bad arguments to the public entry points raise an error naming the argument, up front.

Each case here came out of an adversarial sweep of the API on the CPU (session 35). Before, it
raised something from deep inside torch, numpy or the package (an AttributeError on a list, a
TypeError comparing a str, torch's "Could not infer dtype"), was accepted and made every later
offload fail with a warning only, or lost data silently (``restore_blocks`` with a repeated
block id kept one of the two rows meant for that block).
"""

from __future__ import annotations

import math

import pytest
import torch

import torch_pagecomp as pc
from torch_pagecomp import offload_activations, offload_module
from torch_pagecomp.format import STATUS_CHECKSUM, PageCompError


@pytest.fixture
def comp():
    with pc.PageCompressor(device="cpu") as c:
        yield c


# ------------------------------------------------------------------ PageCompressor
@pytest.mark.parametrize("kwargs, match", [
    (dict(device="bogus"), "device must be"),
    (dict(device=torch.device("meta")), "cuda or cpu"),
    (dict(max_pinned_bytes="x"), "max_pinned_bytes must be an int"),
    (dict(max_raw_share=2.0), "max_raw_share must be a number in"),
    (dict(max_raw_share=math.nan), "max_raw_share must be a number in"),
    (dict(max_raw_share="x"), "max_raw_share must be a number in"),
    (dict(raw_bypass="x"), "raw_bypass must be True or False"),
    (dict(stream_priority="x"), "stream_priority must be an int"),
])
def test_compressor_settings_are_checked_by_name(kwargs, match):
    with pytest.raises(PageCompError, match=match):
        pc.PageCompressor(**{"device": "cpu", **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_a_cuda_device_without_cuda_says_so():
    with pytest.raises(PageCompError, match="CUDA is not available"):
        pc.PageCompressor(device="cuda")


def test_a_cuda_index_past_the_devices_says_so(monkeypatch):
    """``cuda:7`` on a machine with one GPU is named (torch's own error came later, from the
    first allocation, naming no argument)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(PageCompError, match="device is cuda:7, but this process sees 1 CUDA"):
        pc.PageCompressor(device="cuda:7")


def test_restore_checks_out_and_device(comp):
    h = comp.offload(torch.randn(100))
    with pytest.raises(PageCompError, match="out must be a torch.Tensor"):
        comp.restore(h, out=[0])
    with pytest.raises(PageCompError, match="cuda or cpu"):
        comp.restore(h, device="meta")
    with pytest.raises(PageCompError, match="out must be on a cpu or cuda device"):
        comp.restore(h, out=torch.empty(100, device="meta"))
    assert torch.equal(comp.restore(h, device="cpu"), comp.restore(h))


def test_a_handle_cannot_be_told_another_shape_or_dtype(comp):
    """A restore allocates and decodes by the handle's shape and dtype: set from outside, it
    handed back memory no page was decoded into."""
    h = comp.offload(torch.randn(5000))
    for name, value in (("shape", torch.Size([10000])), ("dtype", torch.float64),
                        ("nbytes", 1), ("page_size", 8192), ("element_size", 1)):
        with pytest.raises(AttributeError):
            setattr(h, name, value)
    assert h.shape == (5000,) and h.dtype == torch.float32 and h.nbytes == 20000


def test_restore_blocks_refuses_a_repeated_block(comp):
    """``index_copy_`` with a repeated id keeps one of the rows meant for that block and drops
    the other: before, ``restore_blocks(h, cache, [3, 3])`` lost block 1's data silently."""
    cache = torch.randn(8, 4, 256)
    ref = cache.clone()
    h = comp.offload_blocks(cache, torch.tensor([1, 2]))
    with pytest.raises(PageCompError, match="repeat block 3"):
        comp.restore_blocks(h, cache, torch.tensor([3, 3]))
    assert torch.equal(cache, ref)  # nothing written
    comp.restore_blocks(h, cache, torch.tensor([5, 3]))
    assert torch.equal(cache[5], ref[1]) and torch.equal(cache[3], ref[2])
    # gathering a block twice is fine: each row of the handle is read from it
    h2 = comp.offload_blocks(cache, [0, 0])
    assert torch.equal(comp.restore(h2), torch.stack([cache[0], cache[0]]))


@pytest.mark.parametrize("ids, match", [
    (None, "block_ids must be a 1-D int tensor or a sequence of ints"),
    ("12", "block_ids must be"),
    (torch.tensor([0.0, 1.0]), "block_ids must be 1-D int32/int64"),
    (torch.empty(2, dtype=torch.int64, device="meta"), "block_ids must be on a cpu or cuda"),
])
def test_block_ids_are_checked_by_name(comp, ids, match):
    with pytest.raises(PageCompError, match=match):
        comp.offload_blocks(torch.randn(8, 4), ids)


def test_caches_and_host_pages_must_be_tensors(comp):
    with pytest.raises(PageCompError, match="offload takes a torch.Tensor, got list"):
        comp.offload_blocks([[1.0]], [0])
    with pytest.raises(PageCompError, match="offload takes a torch.Tensor, got list"):
        comp.compress_host([1, 2])


# ------------------------------------------------------------------ compress / pack
def test_compress_arguments_are_checked_by_name():
    z = torch.zeros(2, 4096, dtype=torch.uint8)
    for es in (2.0, 4.0, "2"):
        with pytest.raises(PageCompError, match="element_size must be one of"):
            pc.compress(z, element_size=es, backend="cpu")
    for flag in ("yes", None, 1):
        with pytest.raises(PageCompError, match="checksum must be True or False"):
            pc.compress(z, checksum=flag, backend="cpu")
    with pytest.raises(PageCompError, match="meta device"):
        pc.compress(z.to("meta"))
    with pytest.raises(PageCompError, match="meta device"):
        pc.page_checksums(z.to("meta"))


def test_containers_must_hold_tensors():
    z = torch.zeros(2, 4096, dtype=torch.uint8)
    c = pc.compress(z, backend="cpu")
    bad = pc.CompressedPages(c.payload, c.sizes.tolist(), c.kinds, 4096)
    with pytest.raises(PageCompError, match="CompressedPages.sizes must be a torch.Tensor"):
        pc.decompress(bad)
    with pytest.raises(PageCompError, match="CompressedPages.payload is on the meta device"):
        pc.decompress(pc.CompressedPages(c.payload.to("meta"), c.sizes, c.kinds, 4096))
    for thing in (z, None):
        with pytest.raises(PageCompError, match="expected CompressedPages"):
            pc.pack(thing)


def test_a_page_failing_its_checksum_comes_back_zeroed():
    """Status 7 (decoded, but to other bytes than were compressed) zeroes the page as the
    decoders zero the pages they fail: with ``return_status=True`` no caller reads bytes known
    to be wrong."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 4, (3, 4096), dtype=torch.uint8, generator=g)
    c = pc.pack(pc.compress(data, checksum=True, backend="cpu"))
    payload = c.payload.clone()
    start, size = int(c.offsets[1]), int(c.sizes[1])
    assert size > 64
    payload[start + size - 8] ^= 1  # a literal of page 1: still decodes, to other bytes
    bad = pc.CompressedPages(payload, c.sizes, c.kinds, 4096, c.offsets, c.checksums)
    pages, status = pc.decompress(bad, return_status=True, backend="cpu")
    assert status.tolist() == [0, STATUS_CHECKSUM, 0]
    assert not pages[1].any()
    assert torch.equal(pages[0], data[0]) and torch.equal(pages[2], data[2])


# ------------------------------------------------------------------ activation offload
@pytest.mark.parametrize("kwargs, match", [
    (dict(min_ratio="x"), "min_ratio must be a finite number >= 0"),
    (dict(min_ratio=math.inf), "min_ratio must be a finite number >= 0"),
    (dict(min_ratio=-1.0), "min_ratio must be a finite number >= 0"),
    (dict(sample_tensors=0), "sample_tensors must be an int >= 1"),
    (dict(page_size=4095), "page size must be a power of two"),
    (dict(page_size="4096"), "page size must be a power of two"),
    (dict(min_offload_bytes=-1), "min_offload_bytes must be an int >= 0"),
    (dict(min_offload_bytes=1.5), "min_offload_bytes must be an int >= 0"),
    (dict(group_bytes=0), "group_bytes must be an int >= 1 or None"),
    (dict(max_pinned_bytes=-1), "max_pinned_bytes must be an int >= 0 or None"),
    (dict(max_in_flight_tensors=True), "max_in_flight_tensors must be an int >= 1 or None"),
    (dict(prefetch=-1), "prefetch must be an int >= 0"),
    (dict(stream_priority="x"), "stream_priority must be an int"),
    (dict(offload_cpu="yes"), "offload_cpu must be True or False"),
    (dict(keep_param_casts=None), "keep_param_casts must be True or False"),
])
def test_offloader_settings_are_checked_by_name(kwargs, match):
    """Left to the hooks, each of these failed every offload (kept in place, said in a
    warning only), so a step ran with nothing offloaded."""
    with pytest.raises(ValueError, match=match):
        offload_activations(**kwargs)


def test_offload_module_checks_what_it_is_given():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="takes a torch.nn.Module, got function"):
        offload_module(lambda x: x)
    with pytest.raises(ValueError, match="blocks must hold torch.nn.Modules, got int"):
        offload_module(m, blocks=[1])
    with pytest.raises(ValueError, match="keep must hold torch.nn.Modules, got NoneType"):
        offload_module(m, keep=[None])
    with pytest.raises(ValueError, match="offloader must be an ActivationOffloader"):
        offload_module(m, offloader="x")
    with pytest.raises(ValueError, match=r"settings \['prefer'\] go to the ActivationOffloader"):
        offload_module(m, offloader=offload_activations(), prefer="memory")
    off = offload_module(m, offload_cpu=True, min_offload_bytes=0)  # and the good case works
    m(torch.randn(2, 4)).sum().backward()
    assert off.stats()["packed"] > 0
    off.remove()


def test_the_helpers_name_their_arguments():
    with pytest.raises(PageCompError, match="dtype must be a torch.dtype, got str"):
        pc.dtype_element_size("float32")
    with pytest.raises(PageCompError, match="status must be a 1-D tensor"):
        pc.raise_for_status([0, 1])
    status = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(PageCompError, match=r"mismatch must be a tensor shaped as status \(2,\)"):
        pc.raise_for_status(status, torch.tensor([True]))
    with pytest.raises(pc.CorruptPageError):  # and the right arguments still work
        pc.raise_for_status(status, torch.tensor([False, True]))
    with pytest.raises(PageCompError, match="device must be a torch.device or its name"):
        pc.select_backend(4, None)
    with pytest.raises(PageCompError, match="num_pages must be an int >= 0"):
        pc.select_backend(-1, "cpu")
    assert pc.select_backend(4, "cpu") == "cpu"


def test_raise_for_status_names_a_status_it_cannot_read():
    """A status is an integer tensor with bytes: a float one (a page would be named for
    ``status 0.5``, or, requiring grad, numpy refuses it) or a meta one (``item()`` refuses it)
    is an error naming the problem."""
    for status in (torch.tensor([0.0, 0.5]), torch.tensor([0.0, 1.0], requires_grad=True)):
        with pytest.raises(PageCompError, match="status must be an integer tensor"):
            pc.raise_for_status(status)
    with pytest.raises(PageCompError, match="status is on the meta device"):
        pc.raise_for_status(torch.zeros(2, dtype=torch.int32, device="meta"))
    with pytest.raises(PageCompError, match="mismatch is on the meta device"):
        pc.raise_for_status(torch.tensor([0, 2], dtype=torch.int32),
                            torch.zeros(2, dtype=torch.bool, device="meta"))


# ------------------------------------------------------------------ misuse of the hooks
def test_one_offloader_is_used_by_one_forward_thread_at_a_time():
    """torch keeps saved-tensor hooks per thread and the offloader one pass: a second thread
    entering got no hooks, and the last to leave removed hooks it never installed (a torch
    internal assert, and the first thread's hooks left on for good)."""
    import threading

    off = offload_activations(offload_cpu=True, min_offload_bytes=0)
    inside, leave, errors = threading.Event(), threading.Event(), []

    def other():
        try:
            with off:
                pass
        except RuntimeError as exc:
            errors.append(str(exc))
        inside.set()

    with off:
        t = threading.Thread(target=other)
        t.start()
        inside.wait(10)
    leave.set()
    t.join(10)
    assert errors and "another thread" in errors[0]
    x = torch.randn(64, 64, requires_grad=True)
    before = off.stats()["packed"]
    (x * 2).sin().sum().backward()  # outside any ``with``: no hooks left on
    assert off.stats()["packed"] == before
    with off:  # and the offloader works again, from any thread
        y = (x * 2).sin().sum()
    y.backward()
    assert off.stats()["packed"] > before


def test_a_saved_tensor_changed_in_place_raises_as_without_offload():
    """torch checks a saved tensor's version only without saved-tensor hooks: an offloaded
    tensor changed in place after its save fed the backward its old bytes, silently."""
    for change in (lambda b: b.add_(1), lambda b: b[0].zero_()):
        a = torch.ones(64, 64, requires_grad=True)
        with offload_activations(offload_cpu=True, min_offload_bytes=0):
            b = a * 2
            c = b.sin()
        change(b)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            c.sum().backward()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # (deprecated)
def test_quantized_saved_tensors_stay_where_they_are():
    """A quantized tensor's scale and zero point live outside its bytes: offloaded and rebuilt
    from them, it came back without a quantizer (torch asserted on its first use)."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, q):
            ctx.save_for_backward(q)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (q,) = ctx.saved_tensors
            return g * q.q_scale() * 20, None

    q = torch._make_per_tensor_quantized_tensor(
        torch.randint(0, 255, (5000,), dtype=torch.uint8), 0.1, 10)
    x = torch.randn(10, requires_grad=True)
    off = offload_activations(offload_cpu=True, min_offload_bytes=0)
    with pytest.warns(UserWarning, match=r"none offloaded.*'quantized': 1"), off:
        y = Scale.apply(x, q)
    y.sum().backward()
    assert torch.allclose(x.grad, torch.full((10,), 2.0)) and off.stats()["kept_quantized"] == 1


@pytest.mark.parametrize("call, match", [
    (lambda: offload_activations().keep_tensors_of(None), "keep_tensors_of takes a torch.nn"),
    (lambda: offload_activations(prefer="memory", tuner=pc.StepTuner()),
     "tuner is used only with prefer='speed'"),
    (lambda: pc.StepTuner(trials=1.5), "trials must be an int >= 1"),
    (lambda: pc.StepTuner(warmup="2"), "warmup must be an int >= 0"),
    (lambda: pc.StepTuner(margin=math.nan), "margin must be a finite number >= 0"),
    (lambda: pc.StepTuner(clock=None), "clock must be callable"),
    (lambda: offload_module(torch.nn.Linear(2, 2), blocks=5),
     "blocks must be an iterable of torch.nn.Modules"),
    (lambda: offload_module(torch.nn.Linear(2, 2), keep=torch.nn.Linear(2, 2)),
     "keep must be an iterable of torch.nn.Modules"),
])
def test_hook_settings_and_helpers_name_their_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_stats_have_the_byte_counts_from_the_start():
    st = offload_activations().stats()
    assert st["packed"] == 0 and st["offloaded_bytes"] == 0
