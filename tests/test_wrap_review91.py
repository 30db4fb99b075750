"""Review 91 of ``offload_module`` (``offload._wrap``) and the torchtune / TRL drop-ins: what an
interrupted forward leaves behind once the hooks come off, models deep-copied with their
hooks, and arguments that silently did nothing (CPU; gradients compared bit for bit)."""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn

from tests.test_integrations import TinyDecoder, assert_identical, grads
from tests.test_integrations_review import head_interrupted
from torch_pagecomp.integrations.torchtune import (
    OffloadActivations,
    get_act_offloading_ctx_manager,
)
from torch_pagecomp.offload import offload_activations, offload_module
from torch_pagecomp.offload._entry import _tls

pytestmark = pytest.mark.usefixtures("quiet")


@pytest.fixture
def cleanup():
    """Offloaders to take out of a pass left open, and this thread's keep_on_gpu depth put
    back, after the test: a failing test must not leave saved-tensor hooks or a region on the
    worker's thread for the tests after it."""
    refs, depth = [], _tls.keep
    yield lambda off: refs.append(weakref.ref(off))  # (weak: a test checks it is collected)
    for ref in refs:
        off = ref()
        while off is not None and off._depth > 0:  # (not below zero: no end)
            off.__exit__(None, None, None)
    _tls.keep = depth


class Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d)) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x.square().mean()


def _step(model, x) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).backward()
    return [p.grad.clone() for p in model.parameters()]


def _interrupt_once(module: nn.Module):
    """Raise ``KeyboardInterrupt`` at ``module``'s next forward (a pre-hook after the
    package's: torch runs no ``always_call`` hook after it)."""
    def stop(mod, args):
        handle.remove()
        raise KeyboardInterrupt

    handle = module.register_forward_pre_hook(stop)


def test_remove_after_an_interrupted_forward_ends_its_pass(seed, cleanup):
    """Ctrl-C inside a forward under ``offload_module`` left the offloader entered (its
    saved-tensor hooks on the thread) and a ``keep`` region open; only the next forward of
    the module closed them. ``remove()`` did not: every tensor saved on the thread later, with
    the hooks long off, still went into that pass (never ended), torch's hook stack kept the
    offloader alive for good, and the open region kept every other offloader's tensors in
    place. Now ``remove()`` ends both."""
    model, x = Net(), torch.randn(4, 9, 32)
    ref = _step(model, x)
    off = offload_module(model, keep=model.blocks[2:], offload_cpu=True, min_offload_bytes=0,
                         group_bytes=None)
    cleanup(off)
    assert_identical(ref, _step(model, x))
    _interrupt_once(model.blocks[2][1])  # inside the kept block
    with pytest.raises(KeyboardInterrupt):
        _step(model, x)
    assert off._depth == 1 and _tls.keep == 1  # what the interrupt left
    off.remove()
    assert off._depth == 0 and off._hooks is None and _tls.keep == 0
    packed = off.stats()["packed"]
    assert_identical(ref, _step(model, x))  # the hooks off: nothing reaches the offloader
    assert off.stats()["packed"] == packed

    # another offloader on the thread offloads again (no region left open)
    other = offload_activations(offload_cpu=True, min_offload_bytes=0, prefetch=0)
    model.zero_grad(set_to_none=True)
    with other:
        loss = model(x)
    loss.backward()
    assert other.stats()["offloaded_bytes"] > 0 and "kept_region" not in other.stats()

    # and nothing keeps the removed offloader alive
    ref_off = weakref.ref(off)
    del off
    gc.collect()
    assert ref_off() is None


@pytest.mark.parametrize("how", ["remove", "collect"])
def test_a_ctx_taken_off_closes_the_head_region_an_interrupt_left_open(seed, cleanup, how):
    """Ctrl-C inside the head's forward outside the ctx (an evaluation) leaves the head's
    keep_on_gpu region open on the thread; only a later pass of that ctx closed it. A ctx
    removed, or dropped and collected (a recipe making a ctx per step, a re-run notebook
    cell), never has one: the region stayed open for good, and every offloader on the thread
    kept every tensor in place ("region"), a new ctx for the same model included. Taking the
    hooks off now closes it."""
    model, loss, ref, ctx = head_interrupted(ctx_inside=False)
    assert _tls.keep == 1
    if how == "remove":
        ctx.remove()
    else:
        gone = weakref.ref(ctx)
        del ctx
        gc.collect()
        assert gone() is None
    assert _tls.keep == 0
    fresh = get_act_offloading_ctx_manager(model, True, min_offload_size=0, offload_cpu=True)
    assert_identical(ref, grads(model, loss, fresh))
    st = fresh.stats()
    # only the head's forward kept tensors: the rest was offloaded
    assert st["offloaded_bytes"] > 0 and 0 < st["kept_region"] < st["packed"] - st["kept_param"]
    fresh.remove()


@pytest.mark.parametrize("hooks", ["ctx", "offload_module"])
def test_a_model_with_the_hooks_can_be_deep_copied(seed, cleanup, hooks):
    """``copy.deepcopy`` of a model whose head (``get_act_offloading_ctx_manager``) or
    ``keep`` blocks (``offload_module``) carry the hooks raised ``TypeError: cannot pickle
    '_thread._local' object``: an EMA copy, ``AveragedModel`` and TRL's reference model all
    deep-copy the model. The copy shares the hooks, as torchtune's lambdas are shared: it
    trains with the same gradients, its head's tensors kept, no region left open."""
    model = TinyDecoder()
    tokens = torch.randint(0, 50, (2, 8))
    if hooks == "ctx":
        ctx = get_act_offloading_ctx_manager(model, True, min_offload_size=0, offload_cpu=True)
    else:
        ctx = None
        off = offload_module(model, keep=[model.output], offload_cpu=True,
                             min_offload_bytes=0, group_bytes=None)
        cleanup(off)
    twin = copy.deepcopy(model)
    avg = torch.optim.swa_utils.AveragedModel(model)
    assert isinstance(avg.module, TinyDecoder)
    ref = grads(twin, lambda: twin(tokens).square().mean())  # (hooks and all)
    owner = ctx if ctx is not None else off
    kept = owner.stats().get("kept_region", 0)
    assert_identical(ref, grads(twin, lambda: twin(tokens).square().mean(), ctx))
    assert owner.stats()["kept_region"] > kept and _tls.keep == 0
    assert_identical(ref, grads(model, lambda: model(tokens).square().mean(), ctx))
    assert _tls.keep == 0
    owner.remove()


@pytest.mark.parametrize("container", [
    lambda: nn.ModuleList(nn.Linear(4, 4) for _ in range(2)),
    lambda: nn.ModuleDict({"a": nn.Linear(4, 4)}),
], ids=["ModuleList", "ModuleDict"])
def test_offload_module_refuses_a_module_that_is_never_called(container):
    """``offload_module(model.layers)`` (a ModuleList: no forward, never called) installed
    hooks that never ran: every step offloaded nothing, with no error and no warning (the
    warning comes at the end of a pass, and there was none). It now says what to pass."""
    mods = container()
    with pytest.raises(ValueError, match="has no forward"):
        offload_module(mods, offload_cpu=True)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in mods.modules())


def test_max_fwd_stash_size_is_an_int_of_at_least_one():
    """A float was refused as if it were below 1 ("should be at least 1 but is 2.0"), a numpy
    int (a value read from a config array) likewise; torchtune takes the latter."""
    with pytest.raises(ValueError, match=r"should be an int \(at least 1\) but is 2.0"):
        OffloadActivations(max_fwd_stash_size=2.0)
    with pytest.raises(ValueError, match="should be at least 1 but is"):
        OffloadActivations(max_fwd_stash_size=np.int64(0))
    off = OffloadActivations(max_fwd_stash_size=np.int64(3))
    assert off.max_in_flight_tensors == 3
    with contextlib.suppress(Exception):
        off.close()


@pytest.mark.parametrize("second", [False, True])
def test_an_offloader_kept_does_not_keep_its_models_alive(gen, second):
    """The offloader held the modules whose tensors it keeps (``keep_tensors_of``) strongly:
    kept by the user (or passed to ``offload_module`` for another model) without
    ``remove()``, it kept every model it had hooked alive, GPU parameters and all. Now a model
    dropped is collected, and the offloader goes on working for the next."""
    x = torch.randn(4, 32, generator=gen)
    model = Net()
    off = offload_module(model, offload_cpu=True, min_offload_bytes=0, prefetch=0,
                         mode="uncompressed")
    model(x).square().sum().backward()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    if second:  # the same offloader for another model: its gradients bit-identical
        other = Net()
        want = [g.clone() for g in _grads(other, x)]
        offload_module(other, offloader=off)
        got = _grads(other, x)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert off.stats()["offloaded_bytes"] > 0


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def test_an_offloader_dropped_with_its_model_goes_without_the_cyclic_collector(gen):
    """``offload_module`` put a function holding the offloader into the offloader's own
    handles (``remove()`` ends what an interrupt left open): a cycle, so an offloader and its
    model dropped without ``remove()`` kept the offloader (its pinned pools and stores) until
    the cyclic collector ran. Dropped now, both go at once."""
    x = torch.randn(4, 32, generator=gen)
    model = Net()
    off = offload_module(model, offload_cpu=True, min_offload_bytes=0, prefetch=0,
                         mode="uncompressed")
    model(x).square().sum().backward()
    assert off.stats()["offloaded_bytes"] > 0
    refs = weakref.ref(model), weakref.ref(off)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del model, off
        assert all(r() is None for r in refs), [r() is None for r in refs]
    finally:
        if enabled:
            gc.enable()


def test_remove_whose_pass_end_raised_does_not_end_it_again(seed, cleanup):
    """``remove()`` ends the pass an interrupted forward left open. Where that end raised (an
    interrupt in a store, a warning made an error), the count of forwards entered was still
    there, and the next ``remove()`` ended the pass a second time: the offloader's depth went
    below zero, and every later ``with`` raised that it was inside a forward on another
    thread."""
    model, x = Net(), torch.randn(4, 9, 32)
    ref = _step(model, x)
    off = offload_module(model, offload_cpu=True, min_offload_bytes=0, group_bytes=None)
    cleanup(off)
    _interrupt_once(model.blocks[1][1])
    with pytest.raises(KeyboardInterrupt):
        _step(model, x)
    assert off._depth == 1

    def end_raises():
        del off._warn_if_nothing_offloaded  # once
        raise RuntimeError("the pass's end raised")

    off._warn_if_nothing_offloaded = end_raises
    with pytest.raises(RuntimeError, match="the pass's end raised"):
        off.remove()
    assert off._depth == 0 and off._hooks is None
    off.remove()
    assert off._depth == 0
    offload_module(model, offloader=off)  # usable again
    assert_identical(ref, _step(model, x))
    assert off._depth == 0 and off.stats()["offloaded_bytes"] > 0
    off.remove()


class _Recursing(Net):
    """``Net`` whose forward calls itself once more without grad (a module that scores its
    own output, as a teacher or a reward head might), inside its own forward."""

    def forward(self, x, inner: bool = False):
        if not inner:
            with torch.no_grad():
                self.seen = self(x, inner=True)
        return super().forward(x)


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_a_forward_without_grad_enters_no_pass(gen, cleanup, no_grad):
    """Every forward under ``offload_module`` entered the offloader: a forward without grad
    (evaluation; ``generate()``, once a token) saves nothing, yet paid a pass's set-up, and
    the pass's start stored what a training forward before it still held for its backward.
    Now it enters none: the storages a training forward held stay held, and the gradients
    are bit-identical."""
    model = Net(n=4)
    x = torch.randn(8, 32, generator=gen)
    want = _step(model, x)
    off = offload_module(model, offload_cpu=True, min_offload_bytes=0, mode="uncompressed")
    cleanup(off)
    passes = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: passes.append(off._pass))
    _step(model, x)  # settled
    loss = model(x)  # a training forward: its last groups held for the backward
    held = off._batcher.members
    with no_grad():
        model(x)
    assert passes[-1] is None and off._depth == 0
    assert held > 0 and off._batcher.members == held
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    assert passes[-2] is not None


def _depths_in_a_step(model: Net, gen, cleanup):
    """``(offloader, its depth at each forward of the last block, the step's gradients, those
    without offload)`` for one step of ``model`` under ``offload_module``."""
    x = torch.randn(8, 32, generator=gen)
    want = _step(model, x)
    off = offload_module(model, offload_cpu=True, min_offload_bytes=0, prefetch=0,
                         mode="uncompressed")
    cleanup(off)
    depths = []
    model.blocks[-1].register_forward_pre_hook(lambda m, a: depths.append(off._depth))
    return off, depths, _step(model, x), want


def test_a_forward_without_grad_inside_one_with_grad_leaves_its_pass_open(gen, cleanup):
    """The module called again without grad inside its own forward: the inner call enters
    no pass (it entered a nested one before), and its end must not end the outer forward's
    (counted as one, the inner call's end exited the outer pass: the rest of that forward's
    saved tensors went unoffloaded, and its own end found nothing to exit)."""
    off, depths, got, want = _depths_in_a_step(_Recursing(), gen, cleanup)
    assert depths == [1, 1] and off._depth == 0  # the inner call's, then the outer's
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert off.stats()["offloaded_bytes"] > 0


class _GradInside(Net):
    """``Net`` whose forward takes a gradient (``torch.autograd.grad``: a penalty, a
    physics-informed residual) through a checkpointed call of itself: the checkpoint's
    recompute runs the module's forward inside that backward, inside the outer forward."""

    def forward(self, x, inner: bool = False):
        if not inner:
            xi = x.detach().requires_grad_()
            y = torch.utils.checkpoint.checkpoint(self, xi, True, use_reentrant=False)
            (g,) = torch.autograd.grad(y, xi)
            x = x + g.detach()
        return super().forward(x)


def test_a_forward_run_inside_a_backward_does_not_end_its_callers_pass(gen, cleanup):
    """A forward of the module inside a backward (a checkpoint's recompute) enters no pass,
    but its end took the open call of the outer forward off: that forward's pass ended at
    once (the rest of its saved tensors went unoffloaded) and its own end found nothing."""
    off, depths, got, want = _depths_in_a_step(_GradInside(), gen, cleanup)
    # the inner call's (in the pass nested), the recompute's (in the backward: the outer's
    # pass), then the outer's
    assert depths == [2, 1, 1] and off._depth == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_another_threads_forward_without_grad_leaves_the_pass_groups(gen, cleanup):
    """A forward without grad on another thread (evaluation beside training) enters no
    pass: its blocks must not start groups in the pass of the thread that trains (before, its
    entry raised; now it ran, and its blocks split the other thread's groups, storing that
    pass's batches from the evaluating thread)."""
    model = Net(n=4)
    x = torch.randn(8, 32, generator=gen)
    want = _step(model, x)
    off = offload_module(model, offload_cpu=True, min_offload_bytes=0, prefetch=0,
                         mode="uncompressed")
    cleanup(off)
    groups = []
    model.blocks[-1].register_forward_hook(
        lambda m, a, o: groups.append(len(off._pass.groups)) if torch.is_grad_enabled() else None)
    _step(model, x)
    errors = []

    def evaluate():
        try:
            with torch.no_grad():
                model(x)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    def midway(mod, args):
        if torch.is_grad_enabled():  # the training thread's forward, not the evaluation's
            t = threading.Thread(target=evaluate)
            t.start()
            t.join()

    handle = model.blocks[1][1].register_forward_pre_hook(midway)
    got = _step(model, x)
    handle.remove()
    assert not errors and groups[1] == groups[0]  # (5 groups, not 4: one split by the other)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and off._depth == 0
