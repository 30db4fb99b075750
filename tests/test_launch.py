"""The direct launch path (``torch_pagecomp.kernels.launch``): after the first launch of a
specialisation, kernels launch through the compiled kernel without ``JITFunction.run``, and a
change Triton would compile differently for (alignment, an int's class, a constexpr) never
reuses the wrong kernel."""

import pytest
import torch
import triton
import triton.language as tl

from torch_pagecomp.kernels import launch as L


@triton.jit
def _scaled_copy(src, dst, n, k, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(src + offs, mask=m)
    tl.store(dst + offs, x * k + SHIFT, mask=m)


def test_argument_classes_separate_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.uint8)
    assert L._arg_class(base) != L._arg_class(base[1:])  # 16-byte alignment
    assert L._arg_class(base) != L._arg_class(base.view(torch.int32))  # dtype
    classes = {L._arg_class(v) for v in (1, 16, 17, 2**31, 2**63)}
    assert len(classes) == 5  # one, divisible by 16, neither, 64-bit, unsigned 64-bit
    assert L._arg_class(32) == L._arg_class(48)
    assert L._arg_class(True) != L._arg_class(False)
    assert L._arg_class(object()) is None
    assert L._meta_key({"BLOCK": 64, "num_warps": 4}) == (("BLOCK", 64), ("num_warps", 4))
    assert L._meta_key({"X": torch.zeros(1)}) is None  # never kept alive by the cache


def test_frozen_meta_is_one_shared_constant_object():
    items = (("BLOCK", 64), ("num_warps", 4))
    meta = L.frozen_meta(items)
    assert meta is L.frozen_meta(items) and meta == dict(items)
    assert hash(meta) == hash(L.frozen_meta(items))  # a cache key, by identity
    for change in (lambda m: m.__setitem__("BLOCK", 32), lambda m: m.update(BLOCK=32),
                   lambda m: m.pop("BLOCK"), lambda m: m.clear()):
        with pytest.raises(TypeError, match="shared"):
            change(meta)
    assert meta == dict(items)
    with pytest.raises(TypeError, match="plain constants"):
        L.frozen_meta((("X", torch.zeros(1)),))


def test_direct_launches_match_and_skip_jit_run(cuda, gen, monkeypatch):
    calls = []
    run = _scaled_copy.run
    monkeypatch.setattr(_scaled_copy, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    L._COMPILED.clear()
    src = torch.randint(0, 100, (4096,), generator=gen, dtype=torch.int32).to(cuda)
    launches = 0
    # the same specialisation launched repeatedly, then every way it can change: the offset
    # view (unaligned), n of class 1 / multiple of 16 / other, a constexpr, another stream
    cases = [(0, 1000, 3, 0)] * 4 + [(1, 1000, 3, 0), (0, 1, 3, 0), (0, 1024, 3, 0),
                                     (0, 1000, 5, 0), (0, 1000, 3, 7), (3, 17, 2, 1)]
    side = torch.cuda.Stream()
    for i, (off, n, k, shift) in enumerate(cases * 2):
        s = src[off:]
        dst = torch.full((4096,), -1, dtype=torch.int32, device=cuda)  # poisoned
        stream = side if i % 3 == 0 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            L.launch(_scaled_copy, (triton.cdiv(n, 256),), cuda, (s, dst, n, k),
                     dict(BLOCK=256, SHIFT=shift, num_warps=4), traced=False)
        launches += 1
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(dst[:n], s[:n] * k + shift), (off, n, k, shift)
        assert (dst[n:] == -1).all(), "wrote past n"
    entries = [v for key, v in L._COMPILED.items() if key[0] == id(_scaled_copy)]
    assert entries and all(v is not None for v in entries), "this Triton cannot launch directly"
    # one JITFunction.run per specialisation (k=5 shares one with k=3), none after
    assert len(calls) == len(entries) < launches, (len(calls), len(entries), launches)


def test_launch_under_the_interpreter_goes_through_triton(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("interpreter only")
    src = torch.arange(100, dtype=torch.int32)
    dst = torch.full((100,), -1, dtype=torch.int32)
    L.launch(_scaled_copy, (1,), src.device, (src, dst, 100, 2), dict(BLOCK=128, SHIFT=1),
             traced=False)
    assert torch.equal(dst, src * 2 + 1)


def test_launch_hooks_send_launches_through_triton(monkeypatch):
    class Chain:  # Triton >= 3.5 keeps hooks in chains that are never None
        def __init__(self, calls):
            self.calls = calls

    class Runtime:
        launch_enter_hook = Chain([])
        launch_exit_hook = None

    monkeypatch.setattr(L, "_RUNTIME", [Runtime()])
    assert not L._hooks_set()
    Runtime.launch_exit_hook = Chain([print])
    assert L._hooks_set()
    Runtime.launch_exit_hook, Runtime.launch_enter_hook = None, print
    assert L._hooks_set()


def test_direct_entry_takes_what_jit_run_passes_and_refuses_the_unexpected():
    class Compiled:
        function, packed_metadata = 7, ("meta",)

        @staticmethod
        def run(*a):
            return a

    class Kernel:  # Triton's JITFunction as _direct_entry reads it: a binder per device
        def __init__(self, binder):
            self.device_caches = {0: ({}, {}, None, None, binder)}

    def binder(a, b, n, BLOCK=64, SHIFT=0, **options):
        return dict(a=a, b=b, n=n, BLOCK=BLOCK, SHIFT=SHIFT), [], options

    entry = L._direct_entry(Kernel(binder), Compiled(), 0, ("x", "y", 5), dict(SHIFT=3,
                                                                               num_warps=4))
    assert entry is not None
    kernel, run, head, tail = entry
    assert run == Compiled.run  # not a CudaLauncher: called as JITFunction.run calls it
    assert head == (7, ("meta",), None, None, None)  # function, metadata, no hooks
    assert tail == (64, 3)  # the parameters after args: defaults and meta, in order
    assert L._direct_entry(Kernel(binder), object(), 0, ("x", "y", 5), {}) is None
    assert L._direct_entry(object(), Compiled(), 0, ("x", "y", 5), {}) is None
    no_handle = type("NoHandle", (Compiled,), {"function": None})()
    assert L._direct_entry(Kernel(binder), no_handle, 0, ("x", "y", 5), {}) is None


def _launcher_class(call):
    return type("CudaLauncher", (), {"__call__": call, "launch": staticmethod(print),
                                     "launch_cooperative_grid": False, "launch_pdl": True,
                                     "global_scratch_size": 0, "profile_scratch_size": 0})


def test_raw_launch_only_for_the_launcher_layout_it_knows():
    def call_36(self, gridX, gridY, gridZ, stream, function, *args):
        pass

    def call_39(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                launch_enter_hook, launch_exit_hook, *args):
        pass

    launcher = _launcher_class(call_36)()
    assert L._raw_launch(launcher) == (print, False, True)
    assert L._raw_launch(_launcher_class(call_39)()) is None  # another release's layout
    launcher.global_scratch_size = 64  # a kernel that needs scratch: through __call__
    assert L._raw_launch(launcher) is None
    other = type("HIPLauncher", (), {"__call__": call_36})()
    assert L._raw_launch(other) is None

    class Compiled:
        function, packed_metadata = 7, ("meta",)
        run = _launcher_class(call_36)()

    class Kernel:
        device_caches = {0: ({}, {}, None, None, lambda a, n, **o: (dict(a=a, n=n), [], o))}

    kernel, fn, head, tail = L._direct_entry(Kernel(), Compiled(), 0, ("x", 5), {})
    assert fn is print and tail == ()
    # grid and stream, then: function, cooperative, pdl, two scratches, metadata, no hooks
    assert head == (7, False, True, None, None, ("meta",), None, None, None)
