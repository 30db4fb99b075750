"""Which compression path can run here, and why not: the GPU status probe and backend choice."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .kernels.launch import interpreting

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


@functools.cache
def gpu_status() -> GpuStatus:
    """Probe, once, whether the GPU path is usable: CUDA build, driver, device, Triton."""
    try:
        import triton

        version, triton_error = triton.__version__, ""
    except Exception as exc:  # noqa: BLE001 - any import failure means no Triton
        version, triton_error = None, f"Triton is not importable ({type(exc).__name__}: {exc})"
    no = lambda reason, name=None: GpuStatus(False, reason, name, triton_version=version)
    if torch.version.cuda is None:
        return no("torch is a CPU-only build (no CUDA)")
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return no("no CUDA driver or no CUDA device visible")
        name = torch.cuda.get_device_name(0)
        major, _ = torch.cuda.get_device_capability(0)
    except Exception as exc:  # noqa: BLE001
        return no(f"CUDA driver error: {exc}")
    if version is None:
        return no(triton_error, name)
    if major < 7:
        return no(f"{name} is older than compute capability 7.0", name)
    if interpreting():
        return no("TRITON_INTERPRET=1 runs Triton on the CPU", name)
    return GpuStatus(True, "ok", name, triton_version=version)


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
