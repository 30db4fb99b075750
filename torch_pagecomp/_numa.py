"""Page-locked host memory on the GPU's NUMA node.

On a host with several NUMA nodes (a two-socket server: each socket's PCIe root complex serves
its own GPUs) a buffer in the other socket's memory makes every copy to and from the GPU cross
the link between the sockets. The package's page-locked buffers (``pools.HostMemory``:
shared anonymous mappings that the driver registers, which faults every page in) are given
the memory policy ``MPOL_PREFERRED`` for the current CUDA device's node before registration,
so their pages land on that node while it has room, elsewhere when it has none. On
one node, where the device's node is unknown, or where the kernel refuses the call (a
container's seccomp filter), nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

import torch

_MPOL_PREFERRED = 1
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}  # the mbind system call's number
_NODE_ROOT = "/sys/devices/system/node"
_PCI_ROOT = "/sys/bus/pci/devices"
_NODES: dict[int, int | None] = {}  # device index -> its node (None: leave the policy alone)


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library (loaded on first use)."""
    return ctypes.CDLL(None, use_errno=True)


def gpu_node(index: int) -> int | None:
    """The NUMA node of CUDA device ``index`` (its PCI function's ``numa_node`` in sysfs), or
    None on a host of one node or where it is not known. Read once per device."""
    if index not in _NODES:
        node = None
        try:
            nodes = [n for n in os.listdir(_NODE_ROOT) if n[:4] == "node" and n[4:].isdigit()]
            if len(nodes) > 1:
                p = torch.cuda.get_device_properties(index)
                bdf = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
                with open(os.path.join(_PCI_ROOT, bdf, "numa_node")) as f:
                    found = int(f.read().strip())
                node = found if found >= 0 else None  # -1: the firmware does not say
        except (OSError, ValueError, AttributeError, RuntimeError, AssertionError):
            node = None
        _NODES[index] = node
    return _NODES[index]


def prefer_node(addr: int, nbytes: int, node: int) -> bool:
    """Give the pages of ``[addr, addr + nbytes)`` (page-aligned, none touched yet) the policy
    ``MPOL_PREFERRED`` for ``node``; True where the kernel took it."""
    number = _SYS_MBIND.get(platform.machine())
    if number is None or not 0 <= node < 4096 or addr % os.sysconf("SC_PAGE_SIZE"):
        return False
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    try:
        # mbind(start, len, mode, nodemask, maxnode, flags): the kernel reads maxnode - 1 bits
        rc = _libc().syscall(ctypes.c_long(number), ctypes.c_void_p(addr),
                              ctypes.c_ulong(nbytes), ctypes.c_ulong(_MPOL_PREFERRED), mask,
                              ctypes.c_ulong(words * 64 + 1), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        return False
    return rc == 0


def place(addr: int, nbytes: int) -> int | None:
    """Prefer the current CUDA device's node for host memory about to be registered with the
    driver (``[addr, addr + nbytes)``, untouched); the node where that was done, else None."""
    try:
        index = torch.cuda.current_device()
    except (RuntimeError, AssertionError):
        return None
    node = gpu_node(index)
    if node is None or not prefer_node(addr, nbytes, node):
        return None
    return node
