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


# Creating a CUDA event for each mark or wait cost the hooks' hot path more host time than
# the launches around it (on an H200 host, 2 fewer events per stored tensor took ~170 us off an
# offload + restore: ``bench/results/h200_84085be_events``). So events are kept and recorded
# again. For a wait (``handoff``), one event per pair of streams: ``wait_event`` takes the
# event as last recorded when the wait is queued, so recording it again later changes nothing
# that is already queued. For a mark that others keep and query (``mark``), a ring of events
# per stream, reused round-robin: a holder of an event that was recorded again on the same
# stream sees a later point of that stream, which completes only after the point it holds
# (stream order), so every query, wait and synchronize stays at least as strict as before;
# with ``EVENTS_PER_STREAM`` marks between two uses of one event, holders rarely see that.
EVENTS_PER_STREAM = 1024
_RINGS: dict[tuple, list] = {}  # stream key -> [next index, events]
_HANDOFFS: dict[tuple, torch.cuda.Event] = {}


def _key(stream: torch.cuda.Stream) -> tuple:
    return (stream.stream_id, stream.device_index, stream.device_type)


def mark(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event recorded on ``stream`` now (``stream.record_event()``), from the stream's ring
    of kept events (see above); ``None`` for no stream (the CPU)."""
    if stream is None:
        return None
    ring = _RINGS.get(_key(stream))
    if ring is None:
        ring = _RINGS[_key(stream)] = [0, []]
    at, events = ring
    if len(events) < EVENTS_PER_STREAM:
        event = torch.cuda.Event()
        events.append(event)
    else:
        event = events[at]
    ring[0] = (at + 1) % EVENTS_PER_STREAM
    event.record(stream)
    return event


def handoff(before: torch.cuda.Stream, after: torch.cuda.Stream) -> None:
    """``after`` waits for the work queued on ``before`` so far (``after.wait_stream(before)``
    through a kept event per pair of streams)."""
    key = _key(before) + _key(after)
    event = _HANDOFFS.get(key)
    if event is None:
        event = _HANDOFFS[key] = torch.cuda.Event()
    event.record(before)
    after.wait_event(event)
