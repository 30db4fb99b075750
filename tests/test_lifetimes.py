"""Lifetimes (issue #19): clean interpreter exit, close() against other threads, no memory kept
by a failed offload, fork, copies and pickles of a module holding a PageCompressor.

The exit tests run scripts in fresh interpreters (``sys.executable -c``): a worker thread still
inside a torch call when the interpreter finalizes aborts the process, so each script ends with
work in flight and must exit 0 with nothing on stderr. Each runs on the CPU and, where there is
one, on the GPU: once here (each script's exit path in every run of ``make test``), 20 times in
the ``slow`` variant (``make test-slow``: an abort that comes one run in many),
``PAGECOMP_EXIT_WORKERS`` at once (default 3). The ``slow`` FSDP2 test runs the stock-model
bench on two ranks under ``torchrun`` 20 times (gloo on the CPU; NCCL too with two GPUs),
``PAGECOMP_TORCHRUN_WORKERS`` at once (default 1: each run keeps two ranks busy).
"""

import copy
import gc
import json
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import torch_pagecomp  # noqa: F401  (registers torch.ops.pagecomp)
from torch_pagecomp import module
from torch_pagecomp.module import PageCompressor
from torch_pagecomp.pipeline import PipelineStopped

# the workers themselves are tested here: every offload goes to them (conftest.py)
pytestmark = pytest.mark.usefixtures("through_the_workers")


ROOT = pathlib.Path(__file__).resolve().parents[1]
PRELUDE = "import torch\nimport torch_pagecomp\nfrom torch_pagecomp import PageCompressor\n"
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def prelude(device: str) -> str:
    # two default batches of the compressor: with the script's last line returning right
    # after offload(), its worker threads are still busy when the interpreter exits
    return PRELUDE + textwrap.dedent(f"""
        dev = torch.device({device!r})

        def two_batches(comp, device=dev):
            return torch.randn(2 * comp.batch_pages * comp.page_size // 4, device=device)
    """)


# each ends with batches in flight, on ``dev`` (the CPU, or the GPU where there is one)
EXIT_SCRIPTS = {
    "offload_no_close": """
        comp = PageCompressor(device=dev)
        h = comp.offload(two_batches(comp))
    """,
    "offload_then_close": """
        comp = PageCompressor(device=dev)
        h = comp.offload(two_batches(comp))
        comp.close()
    """,
    "with_block": """
        with PageCompressor(device=dev) as comp:
            h = comp.offload(two_batches(comp))
    """,
    "offload_restore": """
        comp = PageCompressor(device=dev)
        x = torch.randn(1 << 18, device=dev)
        assert torch.equal(comp.restore(comp.offload(x), device=dev), x)
        h = comp.offload(two_batches(comp))
    """,
    # on a GPU a tensor of one batch or less takes the kernel-only store (no thread): its
    # pages are still packing into pinned chunks when the interpreter exits
    "small_offloads_no_close": """
        comp = PageCompressor(device=dev)
        hs = [comp.offload(torch.randn(1 << 18, device=dev)) for _ in range(8)]
        comp.restore(hs[0])
    """,
    # a GPU compressor fed from host memory (the upload stage), as the default device gives
    "host_tensor_to_gpu": """
        comp = PageCompressor()
        assert comp.device.type == dev.type
        h = comp.offload(two_batches(comp, device="cpu"))
    """,
    # the activation offload hooks in every mode, with a backward and with the graph left
    # alive at exit (offload_cpu: the CPU run offloads its CPU tensors). The hooks' peak rule
    # off, as in conftest: on a GPU this tiny net's allocation falls below its peak within
    # the forward, where the rule holds tensors in place, and nothing would be stored (the
    # case failed on an H200 since the rule, 8615b64, with the hooks' warning on stderr)
    "hooks_with_backward": """
        from torch_pagecomp.offload._batch import Batcher
        Batcher._over_peak = lambda self, dev: None
        lin = torch.nn.Linear(256, 256).to(dev)
        for kw in (dict(mode="uncompressed"), dict(prefer="memory"), dict(prefer="speed")):
            off = torch_pagecomp.offload_activations(offload_cpu=True, min_offload_bytes=0,
                                                     group_bytes=1, **kw)  # a group a tensor
            with off:
                loss = lin(torch.randn(512, 256, device=dev)).relu().square().sum()
            loss.backward()
            assert off.stats()["offloaded_bytes"] > 0
    """,
    "hooks_forward_only": """
        from torch_pagecomp.offload._batch import Batcher
        Batcher._over_peak = lambda self, dev: None  # (as above)
        lin = torch.nn.Linear(256, 256).to(dev)
        keep = []
        for kw in (dict(mode="uncompressed"), dict(prefer="memory"), dict(prefer="speed")):
            off = torch_pagecomp.offload_activations(offload_cpu=True, min_offload_bytes=0,
                                                     group_bytes=1, **kw)  # a group a tensor
            with off:
                keep.append(lin(torch.randn(512, 256, device=dev)).relu().square().sum())
            assert off.stats()["offloaded_bytes"] > 0
    """,
    # a training step under offload_module ending right after a backward whose loss has no
    # Python name (the graph's root held by the engine alone while it runs)
    "offload_module_step": """
        from torch_pagecomp.offload._batch import Batcher
        Batcher._over_peak = lambda self, dev: None  # (as above)
        net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)]).to(dev)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        off = torch_pagecomp.offload.offload_module(net, blocks=list(net), offload_cpu=True,
                                                   min_offload_bytes=0, prefer="memory")
        for _ in range(2):
            net(torch.randn(512, 256, device=dev)).relu().square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert off.stats()["offloaded_bytes"] > 0
        net(torch.randn(512, 256, device=dev)).square().sum().backward()
    """,
    # transformers' generate with the compressed KV cache, left open at exit
    "hf_generate_cache_open": """
        import inspect
        import transformers as tr
        from torch_pagecomp.integrations.transformers import CompressedOffloadedCache
        config = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        model = tr.LlamaForCausalLM(config).to(dev).eval()
        ids = torch.randint(0, 128, (2, 20), device=dev)
        cache = CompressedOffloadedCache(config=config, block_tokens=8)
        kw = "cache" if "cache" in inspect.signature(model.forward).parameters else (
            "past_key_values")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=12, min_new_tokens=12, **{kw: cache})
        assert out.shape == (2, 32)
    """,
    "compress_decompress": """
        x = torch.randint(0, 4, (16 * 4096,), dtype=torch.uint8, device=dev)
        c = torch_pagecomp.compress(x)
        assert c.payload.device.type == dev.type
        assert torch.equal(torch_pagecomp.decompress(c).view(-1), x)
    """,
}
EXIT_CASES = [
    *(pytest.param(n, "cpu", id=f"{n}-cpu") for n in EXIT_SCRIPTS if n != "host_tensor_to_gpu"),
    *(pytest.param(n, "cuda", id=f"{n}-cuda", marks=NEEDS_CUDA) for n in EXIT_SCRIPTS),
]


def _workers(var: str, default: int) -> int:
    n = int(os.environ.get(var, default))
    if n < 1:
        raise ValueError(f"{var} must be >= 1, got {n}")
    return n


def run_script(body: str, timeout: float = 300, device: str = "cpu") -> subprocess.CompletedProcess:
    code = prelude(device) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def assert_clean_runs(run, times: int, workers: int) -> list[subprocess.CompletedProcess]:
    """``run(i)`` ``times`` times, ``workers`` at once; every one exits 0 with an empty stderr."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        runs = list(pool.map(run, range(times)))
    bad = [(r.returncode, r.stderr[-3000:]) for r in runs if r.returncode or r.stderr]
    assert not bad, f"{len(bad)} of {times} runs failed; first: {bad[0]}"
    return runs


def assert_clean_exits(body: str, times: int, device: str = "cpu") -> None:
    """Run the script ``times`` times, ``PAGECOMP_EXIT_WORKERS`` at once (most of each run is
    importing torch)."""
    assert_clean_runs(lambda _: run_script(body, device=device), times,
                      _workers("PAGECOMP_EXIT_WORKERS", 3))


@pytest.mark.parametrize("name,device", EXIT_CASES)
def test_script_exits_cleanly(name, device):
    assert_clean_exits(EXIT_SCRIPTS[name], times=1, device=device)


@pytest.mark.slow
@pytest.mark.parametrize("name,device", EXIT_CASES)
def test_script_exits_cleanly_20_times(name, device):
    assert_clean_exits(EXIT_SCRIPTS[name], times=20, device=device)


def test_exit_joins_the_threads_of_a_compressor_already_collected():
    """A compressor collected before exit leaves its pipeline to the worker thread that ends
    last, which frees it (its tensors too) as it ends; the exit handler joins that thread, so
    no daemon thread is inside a torch call when the interpreter finalizes (it aborted, 4-6 in
    60 pytest runs of the README's quickstart). Here the pipeline's freeing is held for a
    second on that thread: the exit handler waits for it."""
    body = """
        import gc, time
        from torch_pagecomp import module, pipeline
        module.INLINE_HOST_BYTES = 0  # through the workers

        class Held:
            def __del__(self):  # freed with the pipeline, on the thread that drops it last
                time.sleep(1.0)

        def use():
            comp = PageCompressor(device=dev, batch_pages=2)
            x = torch.randn(3 * 4096)
            assert torch.equal(comp.restore(comp.offload(x)), x)
            comp.pipeline._held = Held()

        use()
        gc.collect()
        deadline = time.monotonic() + 10
        while len(pipeline._LIVE) and time.monotonic() < deadline:  # being freed now
            time.sleep(0.01)
        assert not len(pipeline._LIVE)
        pipeline._close_all_at_exit()
        alive = [t.name for t in pipeline._WORKERS if t.is_alive()]
        assert not alive, alive
    """
    r = run_script(body, timeout=120)
    assert r.returncode == 0 and not r.stderr, r.stderr[-3000:]


def test_exit_waits_for_the_engine_to_free_its_backward_end_callbacks():
    """The offloader's end-of-backward callback is held by the autograd engine, which frees it
    (taking the GIL) with its graph task: on a GPU possibly on its device thread just after
    ``backward()`` returned. Asked for the GIL while the interpreter finalizes, that thread
    aborts the process (1 exit in 20 on an H200, ``bench/results/h200_session75``). Here a
    thread stands in for the engine and frees one a little after the script's last line:
    the exit handler waits for it (without the wait, the thread is stopped first and never
    frees it)."""
    body = """
        import threading, time, weakref
        from torch_pagecomp.offload import _backward

        class Owner:
            def _end_backward(self, task):
                pass

        owner = Owner()
        held = [_backward.BackwardEnd(owner, 7)]
        seen = weakref.ref(held[0], lambda _: print("freed", flush=True))

        def engine():  # as the engine's device thread lets a finished graph task go
            time.sleep(0.5)
            held.clear()

        threading.Thread(target=engine, daemon=True).start()
    """
    r = run_script(body, timeout=120)
    assert r.returncode == 0 and not r.stderr, r.stderr[-3000:]
    assert r.stdout.split() == ["freed"], r.stdout


def test_an_error_in_the_end_of_backward_does_not_hold_the_exit():
    """An error raised by the end of a backward reaches ``backward()``'s caller, who may keep
    it (here in a global, as ``sys.last_traceback`` keeps an uncaught one): its traceback
    must not keep the callback alive, or every such exit would wait ``EXIT_WAIT_S``."""
    body = """
        import time
        from torch_pagecomp.offload import _backward

        class Owner:
            def _end_backward(self, task):
                raise RuntimeError("a page failed to decode")

        owner = Owner()
        held = [_backward.BackwardEnd(owner, 3)]
        try:
            held[0]()
        except RuntimeError as exc:
            kept = exc  # its traceback holds the callback's frame
        held.clear()  # as the engine lets the graph task go
        t0 = time.monotonic()
        assert _backward.wait_for_backward_ends(2.0), "the callback is still held"
        print(f"{time.monotonic() - t0:.3f}")
    """
    r = run_script(body, timeout=120)
    assert r.returncode == 0 and not r.stderr, r.stderr[-3000:]
    assert float(r.stdout) < 1.0, r.stdout


def test_backward_end_callbacks_are_freed_and_waited_for():
    """A backward under the hooks queues one :class:`BackwardEnd`, which ends it for its
    offloader and is freed with the graph task (on the CPU by the time ``backward()``
    returns); the exit wait returns at once when none is live and gives up after its
    timeout while one is."""
    from torch_pagecomp.offload import _backward

    lin = torch.nn.Linear(64, 64)
    off = torch_pagecomp.offload_activations(offload_cpu=True, min_offload_bytes=0,
                                             group_bytes=1, mode="uncompressed")
    ends = []
    real = _backward.BackwardEnd.__call__
    _backward.BackwardEnd.__call__ = lambda self: ends.append(self.task) or real(self)
    try:
        with off:
            loss = lin(torch.randn(32, 64)).relu().square().sum()
        loss.backward()
    finally:
        _backward.BackwardEnd.__call__ = real
    assert len(ends) == 1 and not off._backward.tasks  # ended once, for its task
    assert _backward.wait_for_backward_ends(1.0)  # (a GPU test's engine thread may be freeing)

    class Owner:
        def _end_backward(self, task):
            pass

    owner = Owner()
    kept = _backward.BackwardEnd(owner, 1)
    t0 = time.monotonic()
    assert not _backward.wait_for_backward_ends(0.05)
    assert time.monotonic() - t0 >= 0.05
    kept()  # (ends nothing: its owner's end is a no-op)
    del kept
    assert _backward.wait_for_backward_ends(0.0)


# ----------------------------------------------------------------------------- FSDP2, torchrun
FSDP_BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")),
]


def torchrun_fsdp(backend: str, out: pathlib.Path) -> subprocess.CompletedProcess:
    """The stock-model bench under FSDP2 on two ranks, every offload mode, one step each;
    gloo on the CPU, NCCL on two GPUs."""
    device = "cpu" if backend == "gloo" else "cuda"
    # OMP_NUM_THREADS set: else torchrun says on stderr that it set it
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "bench.stock_models", "--fsdp", "--device", device,
           "--models", "encoder-tiny", "--variants", "uncompressed,memory,speed",
           "--steps", "1", "--warmup", "1", "--min-offload-bytes", "4096", "--out", str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("backend", FSDP_BACKENDS)
def test_fsdp2_torchrun_exits_cleanly_20_times(backend, tmp_path):
    """Every rank of every run exits 0 and nothing reaches stderr (the bench reports a process
    group's thread that outlived its teardown there)."""
    outs = [tmp_path / f"run{i}.json" for i in range(20)]
    assert_clean_runs(lambda i: torchrun_fsdp(backend, outs[i]), 20,
                      _workers("PAGECOMP_TORCHRUN_WORKERS", 1))
    doc = json.loads(outs[0].read_text())
    assert doc["gpus"] == 2
    assert [r["variant"] for r in doc["rows"]] == ["uncompressed", "memory", "speed"]
    assert all(r["offloaded_gib"] > 0 for r in doc["rows"]), doc["rows"]


# ----------------------------------------------------------------------------- close vs threads
def start_thread(fn) -> tuple[threading.Thread, list]:
    """Run ``fn`` in a thread; the list gets its exception (or None)."""
    result: list = []

    def body():
        try:
            fn()
            result.append(None)
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th, result


def test_close_wakes_a_thread_waiting_to_offload():
    # one 4 KiB batch in flight at a time: a 64 MiB offload spends its time waiting for room
    # (~5 s on a 2-core runner; 4 MiB took 0.35 s there, too close to the 0.3 s below)
    pc = PageCompressor(device="cpu", batch_pages=1, slots=1, max_pinned_bytes=4096)
    th, result = start_thread(lambda: pc.offload(torch.randn(1 << 24)))
    time.sleep(0.3)
    assert th.is_alive(), "the offload should still be waiting for back-pressure"
    closer, closed = start_thread(pc.close)
    th.join(1.0)
    assert not th.is_alive(), "close() left the offloading thread waiting"
    assert isinstance(result[0], PipelineStopped) and "closed" in str(result[0])
    closer.join(10)
    assert closed == [None] and not any(t.is_alive() for t in pc.pipeline._threads)
    with pytest.raises(RuntimeError, match="closed"):
        pc.offload(torch.ones(10))


def test_close_wakes_a_thread_waiting_for_a_slot():
    pc = PageCompressor(device="cpu", batch_pages=1, slots=2)
    p = pc.pipeline
    held = [p.acquire_slot(), p.acquire_slot()]  # the ring is full: the next offload waits
    th, result = start_thread(lambda: pc.offload(torch.ones(4096)))
    time.sleep(0.2)
    assert th.is_alive()
    closer, closed = start_thread(pc.close)  # wakes the producer, then drains `held`
    th.join(1.0)
    assert not th.is_alive() and isinstance(result[0], PipelineStopped)
    assert closer.is_alive()  # still draining: `held` are in flight
    for slot in held:
        p._release_slot(slot)
    closer.join(10)
    assert closed == [None] and not any(t.is_alive() for t in p._threads)


def test_a_worker_that_cannot_start_leaves_no_thread_running(monkeypatch):
    """A ``PageCompressor`` whose second worker thread cannot start (the process's thread
    limit) raises, and the worker that did start ends: it does not wait on its queue for
    ever, keeping the half-made pipeline (and its memory) alive until the process exits."""
    from torch_pagecomp import pipeline as pipeline_module

    real, started = threading.Thread.start, []

    def second_fails(self):
        if self.name.startswith("pagecomp-"):
            if len(started) == 1:
                raise RuntimeError("can't start new thread")
            started.append(self)
        return real(self)

    before = set(pipeline_module._LIVE)
    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", second_fails)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            PageCompressor(device="cpu", batch_pages=1)
    assert len(started) == 1
    started[0].join(5)
    assert not started[0].is_alive(), "the worker that started is still running"
    assert not set(pipeline_module._LIVE) - before, "the half-made pipeline is still live"
    del before
    x = torch.randn(5000)
    with PageCompressor(device="cpu", batch_pages=1) as pc:  # threads start again
        assert torch.equal(pc.restore(pc.offload(x)), x)


def test_dead_worker_wakes_producers_and_handles(monkeypatch):
    """A worker thread that dies breaks the pipeline: every waiter raises, none hangs."""
    pc = PageCompressor(device="cpu", batch_pages=1, slots=1)
    p = pc.pipeline

    def die(*_):
        raise RuntimeError("worker died")

    monkeypatch.setattr(p, "_complete", die)
    monkeypatch.setattr(p, "_fail", die)  # the error path fails too: the loop itself ends
    h = pc.offload(torch.randn(1024))  # one batch, never completed
    t0 = time.monotonic()
    with pytest.raises(PipelineStopped, match="worker thread failed"):
        h.wait()
    assert time.monotonic() - t0 < 2 and p.broken is not None
    with pytest.raises(PipelineStopped, match="worker thread failed"):
        pc.offload(torch.randn(1 << 14))
    monkeypatch.undo()
    pc.close(timeout=5)


# ----------------------------------------------------------------------------- memory
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_interrupted_offload_returns_memory(monkeypatch):
    """A ``KeyboardInterrupt`` in the middle of an offload: once the batches already queued
    completed and the cycle collector ran, the handle, the tensor's contiguous copy and the
    stored batches are gone (the stored error keeps no traceback)."""
    pc = PageCompressor(device="cpu", batch_pages=16)
    p = pc.pipeline
    real_submit = p._submit_batch
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise KeyboardInterrupt
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(p, "_submit_batch", interrupted)
    storages: list[weakref.ref] = []

    class TrackedStorage(module.Storage):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            storages.append(weakref.ref(self))

    monkeypatch.setattr(module, "Storage", TrackedStorage)
    big = torch.randn(4096, 2048).t()  # 32 MiB, not contiguous: offload makes a copy

    def fail_once():
        calls["n"] = 0
        with pytest.raises(KeyboardInterrupt):
            pc.offload(big)
        pc.synchronize()
        gc.collect()

    fail_once()  # warm-up: pools and allocator
    base = rss_bytes()
    for _ in range(3):
        fail_once()
    assert all(ref() is None for ref in storages), "a failed offload's handle is still alive"
    s = pc.stats()
    assert s["bytes_held_host"] == 0 and s["inflight_bytes"] == 0
    assert rss_bytes() - base < 16 << 20, (rss_bytes() - base) >> 20
    monkeypatch.undo()
    x = torch.randn(5000)
    assert torch.equal(pc.restore(pc.offload(x)), x)  # the ring recovered
    pc.close()


def test_worker_error_kept_without_traceback(monkeypatch):
    pc = PageCompressor(device="cpu", batch_pages=2)

    def boom(job):
        raise ValueError("boom")

    monkeypatch.setattr(pc.pipeline, "_cpu_compress", boom)
    h = pc.offload(torch.randn(5000))
    with pytest.raises(RuntimeError, match="boom"):
        h.wait()
    err = h._storage.error
    assert isinstance(err, ValueError) and err.__traceback__ is None
    pc.close()


# ----------------------------------------------------------------------------- fork
FORK_SCRIPT = """
    import os, sys, time, warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process
    comp = PageCompressor(batch_pages=4)
    x = torch.randn(1 << 16)
    h = comp.offload(x)

    def child(use):
        try:
            use()
        except RuntimeError as exc:
            print("child error:", exc, flush=True)
            os._exit(3)
        os._exit(0)

    def fork_and_wait(use):
        pid = os.fork()
        if pid == 0:
            child(use)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(pid, 9)
        return "hang"

    print("restore:", fork_and_wait(lambda: comp.restore(h)), flush=True)
    print("offload:", fork_and_wait(lambda: comp.offload(x)), flush=True)
    print("synchronize:", fork_and_wait(comp.synchronize), flush=True)
    pid = os.fork()
    if pid == 0:  # a child that never uses it exits normally (its atexit handlers run)
        sys.exit(0)
    print("exit:", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    assert torch.equal(comp.restore(h, device="cpu"), x)  # the parent's compressor works
"""


def test_fork_child_gets_a_clear_error():
    r = run_script(FORK_SCRIPT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for what in ("restore", "offload", "synchronize"):
        assert f"{what}: 3" in out, out
    assert "exit: 0" in out and "hang" not in out, out
    assert "os.fork()" in out and "create a new PageCompressor in the child" in out, out


# ----------------------------------------------------------------------------- copies
def check_fresh_copy(original: PageCompressor, twin: PageCompressor) -> None:
    assert twin is not original and twin.pipeline is not original.pipeline
    assert (twin.page_size, twin.batch_pages, twin.device) == (
        original.page_size, original.batch_pages, original.device)
    assert twin.stats()["offloads"] == 0 and twin.training == original.training
    x = torch.randn(7000)
    assert torch.equal(twin.restore(twin.offload(x)), x)


def test_deepcopy_and_torch_save_of_a_model_holding_a_compressor(tmp_path):
    pc = PageCompressor(device="cpu", page_size=8192, batch_pages=2, element_size=4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), pc)
    model.eval()
    h = pc.offload(torch.randn(3000))  # state that must not travel
    twin = copy.deepcopy(model)
    check_fresh_copy(pc, twin[1])
    assert torch.equal(twin[0].weight, model[0].weight)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    check_fresh_copy(pc, loaded[1])
    assert torch.equal(loaded[0].weight, model[0].weight)
    check_fresh_copy(pc, pickle.loads(pickle.dumps(pc)))
    check_fresh_copy(pc, copy.copy(pc))
    assert h.ready() or h.wait() is None
    for m in (twin[1], loaded[1], pc):
        m.close()


def test_with_block_closes_and_handles_stay_readable():
    x = torch.randn(9000)
    with PageCompressor(device="cpu", batch_pages=2) as pc:
        h = pc.offload(x)
    assert not any(t.is_alive() for t in pc.pipeline._threads)
    assert h.ready() and torch.equal(pc.restore(h), x)
    with pytest.raises(RuntimeError, match="closed"):
        pc.offload(x)
    assert pc.close() is True  # idempotent
