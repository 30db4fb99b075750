"""A stored slice's CUDA driver calls queued by one call (``torch_pagecomp._queue``, C).

The exponent codec's slice queues the same six calls each time: the compress stream waits for
the payload's last slice, the encoder runs, an event; the pack stream waits for it, the plan
runs, an event. Its send queues two copies into the arena and an event. From Python, through
torch's events and Triton's launcher, those cost the hooks about 100 us of host time a slice
inside a training step, for calls that take the driver a few microseconds each
(``bench/results/h200_session63``, ``bench/dev_native_slice.py``); :mod:`._paged` and
:mod:`._arena` hand them to :func:`queue` as one list where :func:`usable` (the extension
was built, and ``libcuda.so.1`` loads), and queue them one by one otherwise.
"""

from __future__ import annotations

try:
    from .. import _queue as _ext
except ImportError:  # built without a C compiler: every call goes the Python way
    _ext = None

_USABLE: list[bool] = []  # found on first use


def usable() -> bool:
    """Whether :func:`queue` can be called (never on a machine without the CUDA driver)."""
    if not _USABLE:
        _USABLE.append(_ext is not None and bool(_ext.available()))
    return _USABLE[0]


def queue(index: int, ops: tuple) -> None:
    """Queue ``ops`` (see ``torch_pagecomp/_queue.c``: waits, records, launches and copies
    by raw handle) in order, with CUDA device ``index``'s primary context current."""
    _ext.queue(index, ops)


def wait(stream: int, event) -> tuple:
    """The op: raw ``stream`` waits for ``event`` (a recorded ``torch.cuda.Event``)."""
    return (0, stream, event.cuda_event)


def record(stream: int, event) -> tuple:
    """The op: record ``event`` (``_events.take``) on raw ``stream``."""
    return (1, stream, event.cuda_event)


def to_host(stream: int, host: int, device: int, nbytes: int) -> tuple:
    """The op: copy ``nbytes`` from device address ``device`` to page-locked ``host``."""
    return (3, stream, host, device, nbytes)
