"""The hooks' cheap stream helpers (``torch_pagecomp.offload._streams``) against torch's own."""

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
