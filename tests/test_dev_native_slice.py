"""``bench.dev_native_slice``'s parts that need no GPU: its C helper builds and loads, a
kernel's parameters are read from its PTX entry, and a launch's parameters follow Triton's
rule (ints equal to 1 specialised away, scratch pointers last) or the probe refuses."""

import shutil
import types

import pytest

from bench import dev_native_slice as nat

PTX = """
.visible .entry _place_slice_kernel(
\t.param .u64 .ptr .global .align 1 _place_slice_kernel_param_0,
\t.param .u64 .ptr .global .align 1 _place_slice_kernel_param_1,
\t.param .u32 _place_slice_kernel_param_2,
\t.param .u64 _place_slice_kernel_param_3,
\t.param .u64 .ptr .global .align 1 _place_slice_kernel_param_4
)
.maxntid 32, 1, 1
{
\tret;
}
"""
ADDR = 0x7F00_0000_1000


def _compiled(ptx=PTX, **md):
    meta = types.SimpleNamespace(num_warps=1, shared=0, **md)
    return types.SimpleNamespace(asm={"ptx": ptx}, metadata=meta, function=0x1234)


def test_ptx_params_reads_the_entry_only():
    assert nat.ptx_params(PTX) == [8, 8, 4, 8, 8]


def test_a_launch_takes_the_arguments_then_the_scratch():
    lane = nat.entry_launch(_compiled(), (ADDR, ADDR + 16, 0, 1 << 40), scratch=1)
    assert (lane.nparams, lane.threads, lane.fn) == (5, 32, 0x1234)
    assert list(lane.vals[:5]) == [ADDR, ADDR + 16, 0, 1 << 40, 0]


def test_an_int_equal_to_1_specialised_away_is_dropped():
    ptx = PTX.replace("\t.param .u32 _place_slice_kernel_param_2,\n", "")
    lane = nat.entry_launch(_compiled(ptx), (ADDR, ADDR + 16, 1, 1 << 40), scratch=1)
    assert lane.nparams == 4
    assert list(lane.vals[:4]) == [ADDR, ADDR + 16, 1 << 40, 0]


@pytest.mark.parametrize("args, md", [
    ((ADDR, ADDR, 0), {}),  # an argument short
    ((ADDR, ADDR, 1 << 40, 1 << 40), {}),  # an i64 where the entry has 4 bytes
    ((ADDR, ADDR, 0, 1 << 40), {"launch_pdl": True}),  # a launch cuLaunchKernel cannot make
])
def test_an_entry_that_does_not_match_is_refused(args, md):
    with pytest.raises(RuntimeError, match="does not match"):
        nat.entry_launch(_compiled(**md), args, scratch=1)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler")
def test_the_helper_builds_and_finds_the_driver_or_says_not(tmp_path):
    dll = nat.build(str(tmp_path))
    assert dll.pc_init() in (0, -1, -2)  # 0 where libcuda.so.1 is there, else why not
