"""Stream switching on the hooks' hot path: every saved tensor and every restore switches
streams a few times, and ``torch.cuda.stream`` costs several device-index lookups each."""

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
        prev = torch.cuda.current_stream()
        if prev.device_index != s.device_index:
            self.ctx = torch.cuda.stream(s)
            self.ctx.__enter__()
            return
        self.prev = prev
        torch.cuda.set_stream(s)

    def __exit__(self, *exc) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
            self.ctx = None
        elif self.prev is not None:
            torch.cuda.set_stream(self.prev)
            self.prev = None
