"""The hooks' cheap stream helpers (``torch_pagecomp.offload._streams``) against torch's own,
and the kept events (``torch_pagecomp._events``)."""

import torch

from torch_pagecomp.offload._streams import current_stream, on_stream


def test_on_stream_switches_and_restores(cuda):
    outer = torch.cuda.current_stream()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with on_stream(a):
        assert torch.cuda.current_stream() == a
        with on_stream(b):
            assert torch.cuda.current_stream() == b
            assert current_stream(cuda) == b
        assert torch.cuda.current_stream() == a
        with on_stream(None):  # the CPU: nothing changes
            assert torch.cuda.current_stream() == a
    assert torch.cuda.current_stream() == outer
    with torch.cuda.stream(b):  # torch's own switch is seen
        assert current_stream(cuda) == b
        assert current_stream(torch.device("cuda", torch.cuda.current_device())) is \
            current_stream(cuda)  # kept, not rebuilt
    assert current_stream(cuda) == outer


def test_on_stream_orders_work(cuda):
    # work queued inside the block runs on the chosen stream: a long copy there, then an
    # event on the same stream, is complete when the event is
    s = torch.cuda.Stream()
    x = torch.randn(1 << 24, device=cuda)
    s.wait_stream(torch.cuda.current_stream())
    with on_stream(s):
        y = x * 2
        ev = s.record_event()
    ev.synchronize()
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(y, x * 2)


def test_kept_events_order_work_and_stay_strict(cuda, monkeypatch):
    """``handoff`` orders a second stream after the first (its event recorded again for each
    hand-off); ``mark`` reuses a ring of events per stream, and a holder of an event recorded
    again still sees it complete only after the point it was first recorded at."""
    from torch_pagecomp import _events

    monkeypatch.setattr(_events, "EVENTS_PER_STREAM", 4)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    _events._RINGS.pop(_events._key(a), None)  # torch reuses stream ids: a fresh ring
    x = torch.randn(1 << 22, device=cuda)
    torch.cuda.synchronize()
    for _ in range(3):  # the same kept event orders every hand-off
        with on_stream(a):
            torch.cuda._sleep(20_000_000)
            y = x * 3
        _events.handoff(a, b)
        with on_stream(b):
            z = y + 1
        torch.cuda.synchronize()
        assert torch.equal(z, x * 3 + 1)
    held = [_events.mark(a) for _ in range(4)]
    assert len({id(e) for e in held}) == 4
    with on_stream(a):
        torch.cuda._sleep(50_000_000)  # ~25 ms
    again = _events.mark(a)  # the ring's first event, recorded again after the sleep
    assert again is held[0]
    assert not held[0].query()  # a holder now waits for the later point: never earlier
    again.synchronize()
    assert all(e.query() for e in held)
    assert _events.mark(None) is None
