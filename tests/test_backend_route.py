"""``backend.route`` is the one backend decision: over every combination of request, device,
GPU status, interpreter and direct-launch eligibility it picks what the four separate choices
before it picked (``api._resolve``/``api._direct`` and the branch order of ``compress`` and
``decompress``, ``_ops._use_triton``, ``select_backend``), written out here as the reference."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from torch_pagecomp import _ops, backend
from torch_pagecomp.format import PageCompError

MIN = backend.MIN_GPU_BATCH_PAGES


def _old_select(num_pages, device, usable):
    if device.type == "cuda":
        return "triton" if usable else "cpu-served"
    return "triton" if usable and num_pages >= MIN else "cpu"


def _old_call(op, requested, num_pages, device, usable, interp, direct):
    """What the public call ran before ``route``: ``host-op`` (the op on host copies),
    ``eager`` (kernels launched directly), ``op`` (the dispatched op), ``interpret``,
    ``upload``, or ``raise``."""
    if requested not in ("auto", "cpu", "triton"):
        return "raise"
    if requested == "auto":
        chosen = _old_select(num_pages, device, usable)
    elif requested == "triton" and device.type != "cuda" and not interp and not usable:
        return "raise"
    else:
        chosen = requested
    cuda = device.type == "cuda"
    direct = direct and cuda and not interp
    if op == "compress":
        if chosen == "cpu":
            return "host-op"
        if chosen == "triton" and direct:
            return "eager" if usable else "op"  # the eager entry falls back to the op
        if cuda or chosen == "cpu-served":
            return "op"
    else:
        if chosen == "cpu" and cuda:
            return "host-op"
        if chosen == "triton" and direct:
            return "eager" if usable else "op"
        if cuda or chosen in ("cpu-served",):
            return "op"
        if chosen == "cpu":  # the op on host tensors: the same call as host-op
            return "host-op"
    return "interpret" if interp else "upload"


_NEW = {backend.CPU: "host-op", backend.KERNELS: "eager", backend.OP: "op",
        backend.CPU_SERVED: "op", backend.INTERPRET: "interpret", backend.UPLOAD: "upload"}


@pytest.fixture
def world(monkeypatch):
    """Set the GPU status, the interpreter flag and direct-launch eligibility route sees."""

    def set_(usable: bool, interp: bool, direct: bool) -> None:
        status = backend.GpuStatus(usable, "ok" if usable else "no GPU here (test)")
        monkeypatch.setattr(backend, "gpu_status", lambda: status)
        monkeypatch.setattr(backend, "interpreting", lambda: interp)
        monkeypatch.setattr(backend, "direct_launch_ok",
                            lambda tensors: direct and not interp
                            and all(t.device.type == "cuda" for t in tensors))

    return set_


@pytest.mark.parametrize("usable,interp,direct",
                         list(itertools.product([False, True], repeat=3)))
def test_route_matches_the_old_choices(world, usable, interp, direct):
    world(usable, interp, direct)
    for op, requested, num_pages, dev in itertools.product(
        ("compress", "decompress"), ("auto", "cpu", "triton", "gpu"), (1, MIN - 1, MIN),
        ("cpu", "cuda"),
    ):
        device = torch.device(dev)
        tensors = [types.SimpleNamespace(device=device)]
        want = _old_call(op, requested, num_pages, device, usable, interp, direct)
        where = (op, requested, num_pages, dev)
        if want == "raise":
            with pytest.raises(PageCompError):
                backend.route(requested, num_pages, device, tensors)
            continue
        assert _NEW[backend.route(requested, num_pages, device, tensors)] == want, where
        assert backend.select_backend(num_pages, dev) == _old_select(num_pages, device, usable)
        t = types.SimpleNamespace(device=device)
        assert _ops._use_triton(t) == (dev == "cuda" and usable), where


def test_route_messages(world):
    world(False, False, False)
    with pytest.raises(PageCompError, match="backend must be one of"):
        backend.route("gpu", 1, "cpu")
    with pytest.raises(PageCompError, match="backend='triton' needs a usable GPU"):
        backend.route("triton", 1, "cpu")
