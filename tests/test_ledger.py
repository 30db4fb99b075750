"""The offloader's host ledger: the peak of stored sizes, however late the sizes are learnt."""

import random

from torch_pagecomp.offload._ledger import HostLedger


class Stored:
    """A stored tensor whose size the host learns when ``known`` is set."""

    def __init__(self, size: int):
        self.size, self.known = size, False

    def host_nbytes(self):
        return self.size if self.known else None


def true_peak(script) -> int:
    now = peak = 0
    for op, s in script:
        now += s.size if op == "add" else -s.size
        peak = max(peak, now)
    return peak


def test_peak_is_that_of_stored_sizes_whenever_they_are_learnt():
    rng = random.Random()
    for _ in range(200):
        stored = [Stored(rng.randrange(1, 1000)) for _ in range(12)]
        script, live = [], []
        for s in stored:  # each added once, removed at a random later point
            script.append(("add", s))
            live.append(s)
            while live and rng.random() < 0.4:
                script.append(("remove", live.pop(rng.randrange(len(live)))))
        script += [("remove", s) for s in live]
        ledger, recs = HostLedger(), {}
        for op, s in script:
            if rng.random() < 0.5:  # sizes arrive late and out of order
                rng.choice(stored).known = True
            if op == "add":
                recs[id(s)] = ledger.add(s, nbytes=5000)
            else:
                s.known = True  # a removed tensor was placed by then (its restore read it)
                ledger.remove(recs[id(s)])
        for s in stored:
            s.known = True
        ledger.settle()
        assert ledger.now == 0 and ledger.peak == true_peak(script)


def test_a_tensor_freed_unsized_counts_at_its_uncompressed_size():
    ledger = HostLedger()
    s = Stored(10)
    rec = ledger.add(s, nbytes=64)
    assert ledger.now == 0  # not settled yet
    ledger.remove(rec)
    assert ledger.peak == 64 and ledger.now == 0


class Placed(Stored):
    """A stored tensor that can say its size after it is freed (``PagedStored``'s
    ``size_when_placed``)."""

    def size_when_placed(self):
        return self.host_nbytes


def test_a_tensor_freed_unsized_counts_at_its_stored_size_once_placed():
    ledger = HostLedger()
    a, b = Placed(10), Placed(7)
    ra = ledger.add(a, nbytes=64)
    rb = ledger.add(b, nbytes=64)
    ledger.remove(ra)  # freed before its placement was read
    assert ledger.peak == 0  # nothing settled: the first event's size is unknown
    assert ra[0] is not a  # the record keeps the size function, not the stored tensor
    a.known = b.known = True
    ledger.remove(rb)
    assert ledger.peak == 17 and ledger.now == 0  # stored sizes, not 64 + 64
