"""Kept CUDA events: marks and stream hand-offs on the hot paths without an event made and
destroyed for each (the offload hooks and stores, the KV cache's store, the compressor's ring).
"""

from __future__ import annotations

import torch

# A CUDA event made for each mark or wait is created, recorded and destroyed on the host for
# every stored tensor, several times over (the store's offload + restore of one tensor took
# 3-45% less host time with kept events, same host: ``bench/results/h200_5144f51_events``).
# So events are kept and recorded again. For a wait (``handoff``), one event per pair of
# streams: ``wait_event`` takes the event as last recorded when the wait is queued, so
# recording it again later changes nothing that is already queued. For a mark that others
# keep and query (``mark``), a ring of events per stream, reused round-robin: a holder of an
# event that was recorded again on the same stream sees a later point of that stream, which
# completes only after the point it holds (stream order), so every query, wait and
# synchronize stays at least as strict as before; with ``EVENTS_PER_STREAM`` marks between
# two uses of one event, holders rarely see that.
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
    key = _key(stream)
    ring = _RINGS.get(key)
    if ring is None:
        ring = _RINGS[key] = [0, []]
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
