"""Which compression path can run here, and why not: the GPU status probe and backend choice."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# Below this many pages, a batch that lives in host memory is compressed on the CPU: the
# upload, launch and download cost more than the lz4 calls.
MIN_GPU_BATCH_PAGES = 256


@dataclass(frozen=True)
class GpuStatus:
    """Result of :func:`gpu_status`. ``usable`` is True when the Triton kernels can run."""

    usable: bool
    reason: str
    device_name: str | None = None
    torch_version: str = torch.__version__
    triton_version: str | None = None


@functools.lru_cache(maxsize=None)
def gpu_status() -> GpuStatus:
    """Probe, once, whether the GPU path is usable: CUDA build, driver, device, Triton."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # noqa: BLE001 - any import failure means no Triton
        triton_version = None
        triton_error = f"Triton is not importable ({exc.__class__.__name__}: {exc})"
    if torch.version.cuda is None:
        return GpuStatus(False, "torch is a CPU-only build (no CUDA)", None, triton_version=triton_version)
    try:
        count = torch.cuda.device_count()
        available = torch.cuda.is_available()
    except Exception as exc:  # noqa: BLE001
        return GpuStatus(False, f"CUDA driver error: {exc}", triton_version=triton_version)
    if not available or count == 0:
        return GpuStatus(False, "no CUDA driver or no CUDA device visible", triton_version=triton_version)
    name = torch.cuda.get_device_name(0)
    if triton_version is None:
        return GpuStatus(False, triton_error, name)
    major, _ = torch.cuda.get_device_capability(0)
    if major < 7:
        return GpuStatus(False, f"{name} is older than compute capability 7.0", name, triton_version=triton_version)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return GpuStatus(False, "TRITON_INTERPRET=1 runs Triton on the CPU", name, triton_version=triton_version)
    return GpuStatus(True, "ok", name, triton_version=triton_version)


def select_backend(num_pages: int, device: torch.device | str) -> str:
    """Choose where a batch of ``num_pages`` pages held on ``device`` is compressed.

    Returns ``"triton"`` (GPU kernels; a host batch of at least ``MIN_GPU_BATCH_PAGES`` pages
    is copied to the GPU and back), ``"cpu-served"`` (CUDA tensor, but no usable GPU path:
    copied to the host, lz4 there, copied back) or ``"cpu"`` (lz4 on the CPU).
    """
    device = torch.device(device)
    usable = gpu_status().usable
    if device.type == "cuda":
        return "triton" if usable else "cpu-served"
    return "triton" if usable and num_pages >= MIN_GPU_BATCH_PAGES else "cpu"
