"""The activation store's driver calls queued by one call (``torch_pagecomp._queue``, C) and
how a Triton kernel's launch is described to it (``kernels.launch.native_params``).

On the CPU: the launch descriptions from stand-in compiled kernels, and the extension's
answer where there is no CUDA driver. On CUDA: copies, events, waits and a Triton kernel
queued by the driver give what the usual calls give, and the exponent codec's store gives
the same bytes whether its slices go by the driver or one call at a time (``_driver`` off).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import POISON

from torch_pagecomp.kernels import launch as L
from torch_pagecomp.offload import _driver
from torch_pagecomp.offload._paged import PagedStore

CUDA = torch.cuda.is_available()
P = 4096

# the head of the PTX entry Triton 3.6 writes for a kernel of three pointers and two ints,
# with its two scratch pointers after them
PTX = """
.visible .entry _k(
	.param .u64 .ptr .global .align 1 _k_param_0,
	.param .u64 .ptr .global .align 1 _k_param_1,
	.param .u64 .ptr .global .align 1 _k_param_2,
	.param .u32 _k_param_3,
	.param .u64 _k_param_4,
	.param .u64 .ptr .global .align 1 _k_param_5,
	.param .u64 .ptr .global .align 1 _k_param_6
)
.reqntid 128
{
	ld.param.u32 %r1, [_k_param_3];
}
"""


class _Meta:
    num_warps, shared, num_ctas = 4, 1024, 1
    launch_cooperative_grid = launch_pdl = False
    global_scratch_size = profile_scratch_size = 0


class _Compiled:
    function = 0xF00
    metadata = _Meta()
    asm = {"ptx": PTX}


PTRS = tuple(L.ptr_class(torch.uint8, 1 << 40) for _ in range(3))


def test_ptx_param_sizes_reads_the_entry_only():
    assert L.ptx_param_sizes(PTX) == [8, 8, 8, 4, 8, 8, 8]
    assert L.ptx_param_sizes(".version 8.0\n") is None


def test_native_params_keeps_the_arguments_and_zeroes_the_scratch():
    classes = PTRS + (L.int_class(5), L.int_class(1 << 40))
    got = L.native_params(_Compiled(), classes)
    assert got == (0xF00, 128, 1024, bytes([8, 8, 8, 4, 8, 8, 8]), (0, 1, 2, 3, 4), 2)


def test_native_params_drops_an_int_triton_specialised_as_one():
    classes = PTRS + (L.int_class(5), L.int_class(1), L.int_class(1 << 40))
    got = L.native_params(_Compiled(), classes)
    assert got is not None and got[4] == (0, 1, 2, 3, 5)


@pytest.mark.parametrize("change", ["sizes", "float", "cooperative", "scratch", "no ptx",
                                    "clusters"])
def test_native_params_refuses_what_it_cannot_lay_out(change):
    compiled, classes = _Compiled(), PTRS + (L.int_class(5), L.int_class(1 << 40))
    md = type("M", (_Meta,), {})()
    compiled.metadata = md
    if change == "sizes":  # a 64-bit int where the entry has 32 bits
        classes = PTRS + (L.int_class(1 << 40), L.int_class(1 << 40))
    elif change == "float":
        classes = PTRS + ((float,), L.int_class(1 << 40))
    elif change == "cooperative":
        md.launch_cooperative_grid = True
    elif change == "scratch":
        md.global_scratch_size = 256
    elif change == "no ptx":
        compiled.asm = {}
    else:
        md.num_ctas = 2
    assert L.native_params(compiled, classes) is None


def test_native_op_only_for_a_kernel_compiled_for_those_arguments(monkeypatch):
    kernel, meta = object(), L.frozen_meta((("BLOCK", 64),))
    classes = PTRS + (L.int_class(5), L.int_class(1 << 40))
    values = (11, 12, 13, 5, 1 << 40)
    assert L.native_op(kernel, 0, meta, classes, values, 7, 99) is None
    monkeypatch.setitem(L._NATIVE, (id(kernel), 0, meta, classes),
                        L.native_params(_Compiled(), classes))
    monkeypatch.setattr(L, "_hooks_set", lambda: False)
    op = L.native_op(kernel, 0, meta, classes, values, 7, 99)
    assert op == (2, 99, 0xF00, 7, 128, 1024, bytes([8, 8, 8, 4, 8, 8, 8]),
                  (11, 12, 13, 5, 1 << 40, 0, 0))
    monkeypatch.setattr(L, "_hooks_set", lambda: True)  # a profiler's hooks: the usual way
    assert L.native_op(kernel, 0, meta, classes, values, 7, 99) is None


def test_the_extension_refuses_without_a_driver():
    """Built by the install wherever a C compiler is (CI's has one); without ``libcuda.so.1``
    it says so and queues nothing."""
    from torch_pagecomp import _queue

    if _queue.available():
        pytest.skip("a CUDA driver is here")
    assert not _driver.usable()
    with pytest.raises(RuntimeError, match="libcuda.so.1"):
        _queue.queue(0, ((1, 0, 1),))


# ------------------------------------------------------------------------------ on CUDA
gpu = pytest.mark.skipif(not (CUDA and _driver.usable()), reason="needs CUDA and its driver")


@triton.jit
def _add_kernel(x_ptr, out_ptr, n, k, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, x + k, mask=i < n)


@gpu
def test_gpu_queued_copies_and_events_order_like_the_usual_calls():
    """A side stream waits (by the driver) for a sleeping producer, copies device bytes into
    page-locked memory and records an event; after the event the bytes are the source's."""
    from torch_pagecomp._events import take

    dev = torch.device("cuda")
    src = torch.randint(0, 256, (3 * P + 5,), dtype=torch.uint8, device=dev)
    host = torch.full((src.numel(),), POISON, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    torch.cuda._sleep(50_000_000)  # the producer's last write lands after the sleep
    src[:7] = 1
    ready = torch.cuda.Event()
    ready.record()
    done = take(side)
    raw = side.cuda_stream
    _driver.queue(dev.index, (_driver.wait(raw, ready),
                              _driver.to_host(raw, host.data_ptr(), src.data_ptr(), P),
                              _driver.to_host(raw, host.data_ptr() + P, src.data_ptr() + P,
                                              src.numel() - P),
                              _driver.record(raw, done)))
    done.synchronize()
    assert torch.equal(host, src.cpu())


@gpu
def test_gpu_a_queued_triton_launch_equals_the_usual_one():
    dev = torch.device("cuda")
    x = torch.randint(0, 100, (5000,), dtype=torch.int32, device=dev)
    out = torch.full_like(x, -1)
    meta = L.frozen_meta((("BLOCK", 1024),))
    args = (x, out, x.numel(), 3)
    classes, values = L.known_args(args)
    grid = triton.cdiv(x.numel(), 1024)
    L.launch(_add_kernel, (grid,), dev, args, meta, traced=False)  # compiles it
    want = out.clone()
    out.fill_(-1)
    raw = torch.cuda.current_stream().cuda_stream
    op = L.native_op(_add_kernel, dev.index, meta, classes, values, grid, raw)
    assert op is not None
    _driver.queue(dev.index, (op,))
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(want, x + 3)


def _bf16(gen: torch.Generator, nbytes: int) -> torch.Tensor:
    x = (torch.randn(nbytes // 2, generator=gen) * 0.02).to(torch.bfloat16)
    return x.view(torch.uint8).cuda()


@gpu
@pytest.mark.parametrize("queued", [True, False])
def test_gpu_exponent_slices_by_the_driver_store_what_the_python_calls_store(gen, monkeypatch,
                                                                              queued):
    """Twelve tensors of 1-40 pages in slices of 8 pages, stored by the exponent codec with
    the slices' calls queued by the driver (after the first slice, which compiles the
    kernels) or one by one; each is placed, sent and restored bit-exactly into a poisoned
    tensor, and the store says how many slices went by the driver."""
    if not queued:
        monkeypatch.setattr(_driver, "_USABLE", [False])
    streams = tuple(torch.cuda.Stream() for _ in range(3))
    store = PagedStore(torch.device("cuda"), P, streams, chunk_bytes=1 << 20,
                       slice_bytes=8 * P)
    producer = torch.cuda.current_stream()
    srcs = [_bf16(gen, int(torch.randint(1, 41, (), generator=gen)) * P) for _ in range(12)]
    stored = [store.offload(s, 2, producer=producer, float_format="bf16") for s in srcs]
    store.wait_placed()
    for s, st in zip(srcs, stored):
        out = torch.full_like(s, POISON)
        store.restore_stream.wait_stream(producer)
        with torch.cuda.stream(store.restore_stream):
            store.restore(st, out)
        producer.wait_stream(store.restore_stream)
        assert torch.equal(out, s)
    torch.cuda.synchronize()
    assert store.failed_restores() == 0
    slices = sum(len(st.slices) for st in stored)
    queued_slices = store.stats()["queued_slices"]  # (the first compiles, unless done before)
    assert slices - 1 <= queued_slices <= slices if queued else queued_slices == 0
    for st in stored:
        store.free(st)
    assert store.arena.used == 0
