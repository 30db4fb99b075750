"""Page-locked host memory on the GPU's NUMA node (``torch_pagecomp._numa``): the memory policy
is set on untouched pages, the device's node is read from sysfs only where the host has several,
and ``HostMemory`` sets it before the driver registers (touches) the pages."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import types

import pytest
import torch

from torch_pagecomp import _numa, pools


def _policy_of(addr: int) -> str | None:
    """The memory policy ``/proc/self/numa_maps`` gives the mapping that starts at ``addr``."""
    with open("/proc/self/numa_maps") as f:
        for line in f:
            start, policy = line.split()[:2]
            if int(start, 16) == addr:
                return policy
    return None


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in _numa._SYS_MBIND
                    or not os.path.exists("/proc/self/numa_maps"),
                    reason="mbind and numa_maps are Linux's (x86_64, aarch64)")
def test_prefer_node_gives_untouched_pages_the_policy():
    """The pages of a fresh anonymous mapping get ``MPOL_PREFERRED`` for node 0 (every Linux host
    has it), and keep it once touched; a mapping left alone keeps the default policy (so the
    check can fail)."""
    n = 16 * 4096
    mine, other = mmap.mmap(-1, n), mmap.mmap(-1, n)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mine))
    addr_other = ctypes.addressof(ctypes.c_char.from_buffer(other))
    if not _numa.prefer_node(addr, n, 0):
        pytest.skip(f"the kernel refused mbind here (errno {ctypes.get_errno()})")
    mine.write(b"x" * n)
    other.write(b"x" * n)
    assert _policy_of(addr) == "prefer:0"
    assert _policy_of(addr_other) == "default"
    assert not _numa.prefer_node(addr + 1, n, 0)  # not page-aligned: not called
    assert not _numa.prefer_node(addr, n, -1)


def _fake_sysfs(tmp_path, nodes: int, numa_node: str | None):
    node_root = tmp_path / "node"
    node_root.mkdir()
    for k in range(nodes):
        (node_root / f"node{k}").mkdir()
    (node_root / "online").write_text("0\n")
    pci_root = tmp_path / "pci"
    dev = pci_root / "0000:8a:00.0"
    dev.mkdir(parents=True)
    if numa_node is not None:
        (dev / "numa_node").write_text(numa_node + "\n")
    return str(node_root), str(pci_root)


@pytest.mark.parametrize("nodes, numa_node, want", [
    (2, "1", 1),  # the GPU's function on the second socket
    (2, "0", 0),
    (1, "0", None),  # one node: nothing to choose
    (2, "-1", None),  # the firmware does not say
    (2, None, None),  # no such file
])
def test_gpu_node_reads_the_functions_node_where_the_host_has_several(
        tmp_path, monkeypatch, nodes, numa_node, want):
    node_root, pci_root = _fake_sysfs(tmp_path, nodes, numa_node)
    monkeypatch.setattr(_numa, "_NODE_ROOT", node_root)
    monkeypatch.setattr(_numa, "_PCI_ROOT", pci_root)
    monkeypatch.setattr(_numa, "_NODES", {})
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x8a, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert _numa.gpu_node(3) == want
    assert _numa._NODES == {3: want}  # read once per device


def test_host_memory_sets_the_node_before_the_driver_registers_its_pages(monkeypatch):
    """``HostMemory(pin=True)`` gives its mapping the device's node first, then registers it
    (registration touches the pages: a policy set after would not move them), and says which
    node it got; unpinned memory is left alone."""
    calls = []
    monkeypatch.setattr(_numa, "place", lambda addr, n: calls.append(("place", addr, n)) or 1)

    class FakeCudart:
        def cudaHostRegister(self, addr, n, flags):
            calls.append(("register", addr, n))
            return 0

        def cudaHostUnregister(self, addr):
            calls.append(("unregister", addr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    mem = pools.HostMemory(5000, pin=True)
    assert calls[:2] == [("place", mem.addr, mem.held_bytes), ("register", mem.addr,
                                                                 mem.held_bytes)]
    assert mem.numa_node == 1 and mem.held_bytes == 8192
    mem.release()
    calls.clear()
    plain = pools.HostMemory(5000, pin=False)
    assert calls == [] and plain.numa_node is None


def test_host_memory_reports_no_node_when_registration_fails(monkeypatch):
    """Memory the driver would not register (``RLIMIT_MEMLOCK``) stays pageable and reports no
    node: its pages are wherever the kernel put them."""
    monkeypatch.setattr(_numa, "place", lambda addr, n: 0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: types.SimpleNamespace(
        cudaHostRegister=lambda addr, n, flags: 2))
    with pytest.warns(UserWarning, match="pageable"):
        mem = pools.HostMemory(4096, pin=True)
    assert not mem.pinned and mem.numa_node is None
