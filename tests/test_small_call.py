"""One small call's host path (``torch_pagecomp._small``, #26): a ``compress`` whose signature
passed every check before runs from a plan; a plain fixed-stride ``decompress`` on a GPU goes
straight to the decoders' known-classes launchers. Both must give the bytes of the full path,
and every argument a plan does not serve must still get the full path's checks and errors.

On the CPU the plans run under the Triton interpreter (``backend="triton"``); what a plan
launches on a GPU (by address) is captured and compared with what the kernels' own launchers
launch. The GPU tests at the end run both paths for real, outputs poisoned.
"""

from __future__ import annotations

import pytest
import torch
from pages import bf16_exponent_pages, mixed_pages

import torch_pagecomp as pc
from torch_pagecomp import _small
from torch_pagecomp import format as fmt
from torch_pagecomp.format import PageCompError
from torch_pagecomp.kernels import exp_codec as X
from torch_pagecomp.kernels import launch as L
from torch_pagecomp.kernels import lz4_compress as C
from torch_pagecomp.kernels import lz4_decompress as D
from torch_pagecomp.kernels.launch import interpreting

P = 4096
POISON = 0xA5
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CODECS = [("lz4", 1), ("lz4", 2), ("lz4", 4), ("exp-bf16", None), ("exp-fp16", 2)]


@pytest.fixture
def interp():
    """The CPU under the Triton interpreter (where the plans run in CI)."""
    if not interpreting():
        pytest.skip("CPU plans run the kernels under TRITON_INTERPRET=1")
    _small._COMPRESS.clear()
    yield "triton"
    _small._COMPRESS.clear()


def _data(gen, n, codec, device="cpu"):
    if codec.startswith("exp"):  # every exponent shape, in turn
        pages = bf16_exponent_pages(gen)
        return pages[torch.arange(n) % pages.shape[0]].to(device)
    return mixed_pages(n, P, gen)[:n].contiguous().to(device)


def _full(data, **kw):
    """``compress`` by the full path (no plan remembered before or after)."""
    _small._COMPRESS.clear()
    try:
        return pc.compress(data, **kw)
    finally:
        _small._COMPRESS.clear()


def _same(a, b):
    assert a.codec == b.codec and a.page_size == b.page_size and a.offsets is None
    assert torch.equal(a.sizes, b.sizes) and torch.equal(a.kinds, b.kinds)
    for i, s in enumerate(a.sizes.tolist()):  # the stored bytes (past them: unspecified)
        assert torch.equal(a.payload[i, :s], b.payload[i, :s]), f"page {i}"


def _no_full_path(monkeypatch):
    """Make the full path fail loudly: a call that reaches it did not run from its plan."""
    def refuse(*a, **k):
        raise AssertionError("the full path ran")

    monkeypatch.setattr(fmt, "as_pages", refuse)


@pytest.mark.parametrize("codec,es", CODECS)
@pytest.mark.parametrize("flat", [False, True], ids=["2d", "1d"])
def test_a_plan_compresses_as_the_full_path(interp, gen, monkeypatch, codec, es, flat):
    """The first call of a signature takes the full path and leaves a plan; the next, on fresh
    bytes of that signature, runs from the plan (the full path refuses here) and stores what
    the full path stores; both round-trip."""
    n = 3 if codec == "lz4" else 6
    first, second = _data(gen, n, codec), _data(gen, n, codec)
    if flat:
        first, second = first.reshape(-1), second.reshape(-1)
    kw = dict(element_size=es, codec=codec, backend=interp)
    pc.compress(first, **kw)
    assert len(_small._COMPRESS) == 1
    want = _full(second, **kw)
    pc.compress(first, **kw)  # (the plan, again)
    with monkeypatch.context() as m:
        _no_full_path(m)
        got = pc.compress(second, **kw)
    _same(got, want)
    assert torch.equal(pc.decompress(got, backend=interp).reshape(-1), second.reshape(-1))


@pytest.mark.parametrize("codec,es", [("lz4", 2), ("exp-bf16", None)])
def test_a_plan_writes_out_and_checks_it(interp, gen, monkeypatch, codec, es):
    """With ``out`` a plan writes the caller's (poisoned) tensors, and still refuses an
    ``out`` that cannot take the call, with the full path's message."""
    x = _data(gen, 4, codec)
    kw = dict(element_size=es, codec=codec, backend=interp)
    want = _full(x, **kw)
    out = pc.compress(x, **kw)
    pc.compress(x, **kw, out=out)  # the full path with out: the plan is learned
    for t in (out.payload, out.sizes, out.kinds):
        t.fill_(POISON)
    with monkeypatch.context() as m:
        _no_full_path(m)
        got = pc.compress(x, **kw, out=out)
    assert got.payload is out.payload and got.sizes is out.sizes and got.kinds is out.kinds
    _same(got, want)
    with monkeypatch.context() as m:
        _no_full_path(m)
        with pytest.raises(PageCompError, match="overlap"):
            pc.compress(out.payload, **kw, out=out)  # same signature, input is the output
    short = pc.compress(x[:2], **kw)
    with pytest.raises(PageCompError, match="holds 2 pages of 4096 bytes, the input 4 pages"):
        pc.compress(x, **kw, out=short)


def test_arguments_a_plan_does_not_fix_get_the_full_checks(interp, gen):
    """A plan is keyed by the call's signature: a tensor of the same shape but another dtype,
    not contiguous, a bool or float element size, a checksum, another backend: each goes the
    full way and gets its own result or error."""
    x = _data(gen, 2, "lz4")
    pc.compress(x, element_size=2, backend=interp)
    assert len(_small._COMPRESS) == 1
    with pytest.raises(PageCompError, match="dtype torch.uint8"):
        pc.compress(x.view(torch.int8), element_size=2, backend=interp)
    wide = torch.zeros((2, 2 * P), dtype=torch.uint8)
    with pytest.raises(PageCompError, match="contiguous"):
        pc.compress(wide[:, :P], element_size=2, backend=interp)
    with pytest.raises(PageCompError, match="element_size must be one of"):
        pc.compress(x, element_size=2.0, backend=interp)
    with pytest.raises(PageCompError, match="checksum"):
        pc.compress(x, element_size=2, backend=interp, checksum=1)
    with pytest.raises(PageCompError, match="pages have 4096 bytes per row but page_size=8192"):
        pc.compress(x, page_size=8192, element_size=2, backend=interp)
    summed = pc.compress(x, element_size=2, backend=interp, checksum=True)
    assert summed.checksums is not None
    assert pc.compress(x, element_size=2, backend="cpu").device.type == "cpu"
    assert len(_small._COMPRESS) == 1  # none of these left a plan


def test_a_meta_tensor_of_a_planned_signature_is_refused(interp, gen):
    """A meta tensor has the signature of a CPU one (``get_device()`` is -1 for both): it must
    get the full path's error, not run a CPU plan's launchers on a tensor without bytes."""
    for codec, es in (("lz4", 2), ("exp-bf16", None)):
        x = _data(gen, 2, codec)
        pc.compress(x, element_size=es, codec=codec, backend=interp)
        with pytest.raises(PageCompError, match="meta device"):
            pc.compress(x.to("meta"), element_size=es, codec=codec, backend=interp)


def test_plans_are_bounded(interp, gen, monkeypatch):
    """Past the limit the plans are forgotten, not kept without end."""
    monkeypatch.setattr(_small, "_PLAN_LIMIT", 2)
    for n in (1, 2, 3):
        pc.compress(_data(gen, n, "lz4"), element_size=2, backend=interp)
    assert len(_small._COMPRESS) == 1


def test_no_plan_under_another_interpreter_setting(interp, gen, monkeypatch):
    """A plan made under the interpreter serves no call once it is off (the full path decides
    again), and none is made for the CPU's own codec."""
    x = _data(gen, 2, "lz4")
    plan_args = (x, None, 2, "lz4", interp, False, None)
    pc.compress(x, element_size=2, backend=interp)
    assert _small.compress_plan(*plan_args) is not None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert _small.compress_plan(*plan_args) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _small._COMPRESS.clear()
    pc.compress(x, element_size=2, backend="cpu")
    assert not _small._COMPRESS


# ------------------------------------------------- what a plan launches on a GPU (captured)
def _capture(monkeypatch, module):
    """``module``'s usual launches, and every known-classes launch (the kernel modules' and
    the plans'), recorded, not run."""
    usual, known = [], []
    monkeypatch.setattr(module, "launch", lambda kernel, grid, device, args, meta, traced=True:
                        usual.append((kernel, tuple(grid), args, meta)))

    def record(kernel, grid, index, meta, classes, values, args, stream=None):
        known.append((kernel, tuple(grid), index, meta, classes, values,
                      args() if callable(args) else args))

    for mod in (L, C, D, X):
        monkeypatch.setattr(mod, "launch_known", record)
    return usual, known


def _check_same_launch(usual, known, scratch_args=()):
    """One launch each: same kernel, grid and settings object, the classes and addresses of
    the usual launch's arguments (scratch, allocated per call by both, by shape only)."""
    assert len(usual) == len(known) == 1
    (k1, g1, a1, m1), (k2, g2, _, m2, classes, values, a2) = usual[0], known[0]
    assert k1 is k2 and g1 == g2 and m1 is m2
    assert classes == tuple(L._arg_class(a) for a in a1)
    for i, (a, v, b) in enumerate(zip(a1, values, a2)):
        if i in scratch_args:
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
        elif isinstance(a, torch.Tensor):  # (host tensors go as they are)
            got = v.data_ptr() if isinstance(v, torch.Tensor) else v
            assert got == a.data_ptr() == b.data_ptr()
        else:
            assert v == a == b


@pytest.mark.parametrize("codec,es", CODECS)
@pytest.mark.parametrize("offset", [0, 4], ids=["aligned8", "aligned4"])
def test_a_plans_gpu_launch_is_the_launchers(interp, gen, monkeypatch, codec, es, offset):
    """``CompressPlan.launch_at`` launches what ``compress_pages`` / ``compress_exp_pages``
    launch for the same tensors: kernel, grid, settings (the load width by the storage
    offset), argument classes and addresses; fewer pages than the interpreter's 3 programs,
    so the grid is the pages'."""
    n = 2
    buf = torch.zeros(n * P + offset, dtype=torch.uint8)
    data = buf[offset:].view(n, P)
    kw = dict(element_size=es, codec=codec, backend=interp)
    pc.compress(data, **kw)
    plan = _small.compress_plan(data, None, es, codec, interp, False, None)
    assert plan is not None
    outs = (torch.empty((n, P), dtype=torch.uint8), torch.empty(n, dtype=torch.int32),
            torch.empty(n, dtype=torch.uint8))
    module = X if codec.startswith("exp") else C
    usual, known = _capture(monkeypatch, module)
    if module is X:
        X.compress_exp_pages(data, codec == "exp-fp16", traced=False, out=outs)
    else:
        C.compress_pages(data, es, traced=False, out=outs)
    plan.launch_at(data, *outs)
    _check_same_launch(usual, known, () if module is X else (4, 5))


@pytest.mark.parametrize("codec,es", [("lz4", 1), ("lz4", 2), ("exp-bf16", None)])
def test_a_direct_decode_is_the_launchers(interp, gen, monkeypatch, codec, es):
    """``_small.decode`` launches what ``decompress_into`` / ``decompress_exp_into`` launch
    for the same container and outputs."""
    c = pc.compress(_data(gen, 3, codec), element_size=es, codec=codec, backend=interp)
    module = X if c.codec == "exp" else D
    usual, known = _capture(monkeypatch, module)
    got_pages, got_status = _small.decode(c.codec, c, None)
    into = X.decompress_exp_into if module is X else D.decompress_into
    into(c.payload.view(-1), None, c.sizes, c.kinds, got_pages, got_status, traced=False)
    assert len(usual) == len(known) == (1 if module is X else 2)
    for u, k in zip(usual, known):
        _check_same_launch([u], [k])


def test_kept_launches_call_the_compiled_kernels_only_when_their_classes_hold(monkeypatch):
    """A plan's launches go the usual way (known classes) until a call with every address
    16-byte aligned finds each kernel's compiled entry; then aligned calls launch the entries
    directly, in order, with the same values, and a misaligned one, or one while Triton's
    hooks are set or another device is current, goes the usual way again."""
    usual, direct = [], []
    monkeypatch.setattr(L, "launch_known", lambda kernel, grid, index, meta, classes, values,
                        args, stream=None: usual.append((kernel, grid, meta, values)))
    monkeypatch.setattr(L, "kept_entry", lambda kernel, index, meta, classes: ("entry", kernel))
    monkeypatch.setattr(L, "launch_entry", lambda entry, grid, index, values, stream:
                        direct.append((entry, grid, values, stream)))
    usable = [True]
    monkeypatch.setattr(L, "entries_usable", lambda index: usable[0])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)
    kept = _small._Kept(0, (5,), (("k1", "m1"), ("k2", "m2")))
    t = torch.zeros(4, dtype=torch.uint8)
    made = lambda: (t, None, 9)  # noqa: E731
    kept((4096 + 4, None), (9,), made)  # misaligned: nothing kept
    assert kept.entries is None and len(usual) == 2
    kept((4096, None), (9,), made)
    assert kept.entries == (("entry", "k1"), ("entry", "k2")) and len(usual) == 4
    kept((8192, None), (9,), made)
    assert direct == [(("entry", "k1"), (5,), (8192, None, 9), 77),
                      (("entry", "k2"), (5,), (8192, None, 9), 77)] and len(usual) == 4
    kept((8192 + 8, None), (9,), made)
    usable[0] = False
    kept((8192, None), (9,), made)
    assert len(direct) == 2 and len(usual) == 8
    assert [u[0] for u in usual[-4:]] == ["k1", "k2", "k1", "k2"]


@pytest.mark.parametrize("es", [1, 2, 4])
def test_a_kept_lz4_launch_takes_a_raw_scratch_block(interp, gen, monkeypatch, es):
    """Once its kernel is kept, a plan's LZ4 launch takes its scratch as a raw block of the
    caching allocator on the launch's stream, of the bytes ``compress_scratch`` would give,
    in the argument the kernel uses (the other: the kept never-touched tensor), and returns
    it after the launch; a misaligned input goes the usual way with scratch tensors."""
    n = 2
    data = _data(gen, n, "lz4")
    pc.compress(data, element_size=es, backend=interp)
    plan = _small.compress_plan(data, None, es, "lz4", interp, False, None)
    events = []
    monkeypatch.setattr(_small, "_RAW_ALLOC", lambda nbytes, stream: events.append(
        ("alloc", nbytes, stream)) or 4096 * 1000)
    monkeypatch.setattr(_small, "_RAW_DELETE", lambda block: events.append(("delete", block)))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 55, raising=False)
    monkeypatch.setattr(L, "entries_usable", lambda index: True)
    monkeypatch.setattr(L, "launch_entry", lambda entry, grid, index, values, stream:
                        events.append(("launch", entry, grid, values, stream)))
    plan.scratch = C.scratch_need(plan.device, plan.cfg, plan.programs)
    plan.kept.entries = ("kept",)
    outs = tuple(t.data_ptr() for t in (data, data, data))  # (addresses only: not launched)
    plan.launch_at(data, data, data, data)
    tabs, shuf = C.compress_scratch(plan.device, plan.cfg, plan.programs, kept_unused=True)
    used, other = (tabs, shuf) if es == 1 else (shuf, tabs)
    assert events[0] == ("alloc", used.numel() * used.element_size(), 55)
    values = events[1][3]
    assert events[1][:3] == ("launch", "kept", (plan.programs,)) and events[1][4] == 55
    assert values[:4] == (data.data_ptr(), *outs) and values[6] == n
    assert values[4 if es == 1 else 5] == 4096 * 1000
    assert values[5 if es == 1 else 4] == other.data_ptr()
    assert events[2:] == [("delete", 4096 * 1000)]
    known = []
    monkeypatch.setattr(C, "launch_known", lambda *a, **k: known.append(a))
    buf = torch.zeros(n * P + 4, dtype=torch.uint8)
    plan.launch_at(buf[4:].view(n, P), data, data, data)  # 4-byte aligned: compress_at
    assert len(events) == 3 and len(known) == 1


def test_direct_decoder_takes_only_plain_gpu_containers(interp, gen):
    """Host containers, packed ones, checksummed ones and ``codec="any"`` go the full way."""
    x = _data(gen, 2, "lz4")
    c = pc.compress(x, element_size=2, backend=interp)
    assert _small.direct_decoder(c, None, "auto") is None  # on the CPU
    summed = pc.compress(x, element_size=2, backend=interp, checksum=True)
    for case in (c, summed, pc.pack(c)):
        for codec in (None, "lz4", "exp", "any"):
            assert _small.direct_decoder(case, codec, "triton") is None


# ----------------------------------------------------------------------------- on a GPU
@gpu
@pytest.mark.parametrize("codec,es", CODECS)
@pytest.mark.parametrize("n", [1, 7, 300])
def test_gpu_plans_and_direct_decodes_match_the_full_path(gen, monkeypatch, codec, es, n):
    """On a GPU: fresh bytes of a learned signature compress from the plan exactly as the full
    path does (storage offsets 0, 4 and 2, the last copied by the full path), and decode
    through the direct decoders into poisoned pages, statuses all OK."""
    _small._COMPRESS.clear()
    kw = dict(element_size=es, codec=codec)
    for offset in (0, 4, 2):
        src = _data(gen, n, codec, "cuda")
        buf = torch.empty(n * P + offset, dtype=torch.uint8, device="cuda")
        data = buf[offset:].view(n, P)
        data.copy_(src)
        want = _full(data, **kw)
        pc.compress(data, **kw)  # learns the signature
        first = pc.compress(data, **kw)  # the plan, through launch_known: keeps the kernel
        got = pc.compress(data, **kw)  # the kept kernel (LZ4: its raw scratch block)
        _same(first, want)
        _same(got, want)
        poisoned = pc.compress(data, **kw)
        for t in (poisoned.payload, poisoned.sizes, poisoned.kinds):
            t.fill_(POISON)
        pc.compress(data, **kw, out=poisoned)  # learns the out= signature
        _same(pc.compress(data, **kw, out=poisoned), want)
        for _ in range(3):  # the decoders' plan: launch_known, then its kept kernels
            out = torch.full((n, P), POISON, dtype=torch.uint8, device="cuda")
            assert _small.direct_decoder(got, None, "auto") == got.codec
            pages, status = pc.decompress(got, return_status=True, out=out)
            assert pages is out and not status.any() and torch.equal(pages, data)
            assert torch.equal(pc.decompress(got), data)
    _small._COMPRESS.clear()


@gpu
@pytest.mark.parametrize("codec,es", [("lz4", 1), ("lz4", 2), ("exp-bf16", None)])
def test_gpu_planned_calls_capture_in_a_cuda_graph(gen, codec, es):
    """A planned compress and a direct decode (kept kernels, raw scratch) captured in a CUDA
    graph replay to the eager bytes on new inputs copied into the captured one."""
    n = 9
    kw = dict(element_size=es, codec=codec)
    static = _data(gen, n, codec, "cuda")
    for _ in range(3):  # learn, keep the kernels, run kept
        c = pc.compress(static, **kw)
        pc.decompress(c, return_status=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture's side stream
        pc.decompress(pc.compress(static, **kw), return_status=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pc.compress(static, **kw)
        pages, status = pc.decompress(captured, return_status=True)
    fresh = _data(gen, n, codec, "cuda")
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    _same(captured, _full(fresh, **kw))
    assert not status.any() and torch.equal(pages, fresh)


@gpu
def test_gpu_direct_decode_reports_corrupt_pages_as_the_full_path(gen):
    """Corrupt pages get the same statuses (and zeroed rows) by the direct decoder as by the
    full path (``codec="any"`` forces it), and the error names them."""
    x = mixed_pages(16, P, gen).cuda()
    c = pc.compress(x, element_size=2)
    c.sizes[3] = P + 1  # a size no page can have
    c.kinds[5] = 7  # no kind
    direct_pages, direct = pc.decompress(c, return_status=True)
    full_pages, full = pc.decompress(c, return_status=True, codec="any")
    assert torch.equal(direct, full) and torch.equal(direct_pages, full_pages)
    assert direct[3] != 0 and direct[5] != 0 and not direct_pages[3].any()
    with pytest.raises(fmt.CorruptPageError, match=r"\b3\b"):
        pc.decompress(c)
