"""The offload-policy probe (``bench/dev_offload_policy.py``, issue #21): each policy patches
what it names, so a GPU run of the probe measures what its table says."""

from __future__ import annotations

import pytest
import torch

from torch_pagecomp.offload import _backward, _hooks, _paged

probe = pytest.importorskip("bench.dev_offload_policy")


@pytest.fixture
def restored(monkeypatch):
    """Whatever the policies patch comes back after the test."""
    monkeypatch.setattr(_paged, "SCRATCH_SLICES", _paged.SCRATCH_SLICES)
    monkeypatch.setattr(_backward, "RESTORE_BATCH_BYTES", _backward.RESTORE_BATCH_BYTES)
    monkeypatch.setattr(_paged.PagedStore, "__init__", _paged.PagedStore.__init__)
    monkeypatch.setattr(_hooks.ActivationOffloader, "_poll", _hooks.ActivationOffloader._poll)


def test_each_policy_changes_what_it_names(restored):
    probe.apply("shipped")
    store = _paged.PagedStore(torch.device("cpu"), 4096)
    assert store.slice_pages == _paged.SLICE_BYTES // 4096
    probe.apply("slice16")
    assert _paged.PagedStore(torch.device("cpu"), 4096).slice_pages == (16 << 20) // 4096
    assert _paged.PagedStore(torch.device("cpu"), 4096, slice_bytes=1 << 20).slice_pages == 256
    probe.apply("scratch2")
    assert _paged.SCRATCH_SLICES == 2
    probe.apply("restore32")
    assert _backward.RESTORE_BATCH_BYTES == 32 << 20
    shipped_poll = _hooks.ActivationOffloader._poll
    probe.apply("keep")
    assert _hooks.ActivationOffloader._poll is not shipped_poll
    with pytest.raises(ValueError, match="unknown policy"):
        probe.apply("nothing")
