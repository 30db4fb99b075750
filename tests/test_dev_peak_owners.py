"""``bench.dev_peak_owners``: the replay of an allocator trace finds the highest allocated
total and what was live then, by owner (the innermost package frame), with blocks allocated
before the trace and freed in it counted against ``before``."""

import os
import random

from bench.dev_peak_owners import chain, owner, peak_blocks, peak_owners, table

PKG = os.path.join("", "x", "torch_pagecomp", "offload", "_paged.py")
KER = os.path.join("", "x", "triton_kernels", "host_pack.py")
MODEL = os.path.join("", "x", "torch", "nn", "modules", "linear.py")


def _frames(*files):
    return [{"filename": f, "line": 1, "name": f"f{i}"} for i, f in enumerate(files)]


def test_owner_is_the_innermost_package_frame():
    assert owner(_frames(MODEL, PKG, KER)) == "_paged.py:f1"
    assert owner(_frames(KER, PKG)) == "host_pack.py:f0"
    assert owner(_frames(MODEL)) == "other" and owner(None) == "other"


def test_the_replay_finds_the_peak_and_its_owners():
    ev = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(PKG)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": _frames(MODEL)},
        {"action": "segment_alloc", "addr": 9, "size": 10**6},  # not an allocation's bytes
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 120, "frames": _frames(KER)},  # peak: 170
        {"action": "free_requested", "addr": 7, "size": 40},  # made before the trace
        {"action": "alloc", "addr": 4, "size": 30, "frames": _frames(MODEL)},  # 160
    ]
    best, at = peak_owners(ev)
    assert best == 170
    assert at == {"other": 50, "host_pack.py:f0": 120}
    ev.append({"action": "alloc", "addr": 5, "size": 15, "frames": _frames(PKG)})  # 175
    best, at = peak_owners(ev)
    assert best == 175
    assert at == {"other": 80, "host_pack.py:f0": 120, "before": -40, "_paged.py:f0": 15}
    assert sum(at.values()) == best


def test_the_replay_of_random_traces_matches_a_running_total():
    """Fresh random traces: the replayed peak is the running total's maximum, and the owners
    at it add up to it."""
    rng = random.Random(os.urandom(8))
    for _ in range(50):
        live, ev, total, best = {}, [], 0, 0
        for addr in range(rng.randint(1, 200)):
            if live and rng.random() < 0.4:
                a = rng.choice(sorted(live))
                ev.append({"action": "free_requested", "addr": a, "size": live.pop(a)})
                total -= ev[-1]["size"]
            size = rng.randint(1, 1000)
            live[addr] = size
            ev.append({"action": "alloc", "addr": addr, "size": size,
                       "frames": _frames(rng.choice((PKG, KER, MODEL)))})
            total += size
            best = max(best, total)
        got, at = peak_owners(ev)
        assert got == best and sum(at.values()) == best


def test_the_table_has_a_row_per_owner_and_a_column_per_variant():
    lines = table("m", {"uncompressed": (1.5, {"other": 1.4, "before": 0.1}),
                        "memory": (1.6, {"other": 1.4, "_paged.py:restore": 0.1,
                                         "before": 0.1})})
    assert lines[1] == "| owner | uncompressed | memory |"
    assert "| **peak (replayed)** | 1.500 | 1.600 |" in lines
    assert "| _paged.py:restore | 0.000 | 0.100 |" in lines
    assert lines[4].startswith("| other |")


def test_the_blocks_at_the_peak_are_the_package_blocks_live_then_with_their_chains():
    ev = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(PKG, MODEL)},
        {"action": "alloc", "addr": 2, "size": 100, "frames": _frames(KER, PKG)},  # 200
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 50, "frames": _frames(MODEL)},
        {"action": "alloc", "addr": 4, "size": 100, "frames": _frames(KER, PKG)},  # peak 250
        {"action": "free_requested", "addr": 4, "size": 100},
        {"action": "alloc", "addr": 5, "size": 90, "frames": _frames(PKG)},  # 240: below it
    ]
    blocks, peak = peak_blocks(ev)
    assert blocks == {("host_pack.py:f0 < _paged.py:f1", 100): 2}
    assert peak == "host_pack.py:f0 < _paged.py:f1"
    assert chain(_frames(MODEL)) == "other"
    assert peak_blocks([]) == ({}, "none")
