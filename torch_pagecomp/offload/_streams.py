"""Stream switching on the hooks' hot path: every saved tensor and every restore switches
streams a few times, and ``torch.cuda.stream`` / ``torch.cuda.current_stream`` cost several
device-index lookups and a ``Stream`` object each."""

from __future__ import annotations

import torch


class on_stream:
    """``with on_stream(s):`` makes ``s`` the current stream, as ``torch.cuda.stream(s)``, at a
    fraction of the host time when ``s`` is on the current device (another device's stream
    goes through ``torch.cuda.stream``); nothing when ``s`` is ``None`` (the CPU)."""

    __slots__ = ("stream", "prev", "ctx")

    def __init__(self, stream: torch.cuda.Stream | None):
        self.stream = stream
        self.prev = self.ctx = None

    def __enter__(self) -> None:
        s = self.stream
        if s is None:
            return
        if s.device_index != torch._C._cuda_getDevice():
            self.ctx = torch.cuda.stream(s)
            self.ctx.__enter__()
            return
        # (stream id, device index, device type) of the current stream: restored as it was
        self.prev = torch._C._cuda_getCurrentStream(s.device_index)
        torch._C._cuda_setStream(s.stream_id, s.device_index, s.device_type)

    def __exit__(self, *exc) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
            self.ctx = None
        elif self.prev is not None:
            torch._C._cuda_setStream(*self.prev)
            self.prev = None


_STREAMS: dict[tuple, torch.cuda.Stream] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` for a CUDA ``device``, without building a new
    ``Stream`` each call: streams are kept by their (id, device, type), which name the same
    CUDA stream for the life of the process (PyTorch's streams come from pools it never
    destroys)."""
    index = device.index if device.index is not None else torch._C._cuda_getDevice()
    key = torch._C._cuda_getCurrentStream(index)
    s = _STREAMS.get(key)
    if s is None:
        s = _STREAMS[key] = torch.cuda.current_stream(index)
    return s
