"""``python -m bench.cpu_threads`` at a tiny size: the JSON it writes and the table it prints."""

import json
import math

import pytest

from bench import cpu_threads


def test_cpu_threads_bench_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGECOMP_COMMIT", "abc1234")
    out = tmp_path / "threads.json"
    rc = cpu_threads.main(["--mib", "0.25", "--threads", "2,1", "--corpora", "text,bf16-relu",
                           "--repeats", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc1234"
    assert doc["device"].startswith("CPU: ") and doc["cores"] >= 1 and doc["date"]
    rows = doc["rows"]
    assert {(r["corpus"], r["op"], r["threads"]) for r in rows} == {
        (c, op, t) for c in ("text", "bf16-relu") for op in ("compress", "decompress")
        for t in (1, 2)}
    for r in rows:
        assert r["element_size"] == (2 if r["corpus"] == "bf16-relu" else 1)
        assert r["gbps"] > 0 and r["seconds"] > 0 and r["ratio"] > 1
        assert abs(r["efficiency"] - r["speedup"] / r["threads"]) < 1e-9
        if r["threads"] == 1:
            assert r["speedup"] == 1.0
    assert "efficiency" in capsys.readouterr().out


def test_host_reference_rows():
    rows = cpu_threads.host_reference([1, 2], repeats=1, mib=1)
    assert {(r["corpus"], r["op"], r["threads"]) for r in rows} == {
        ("host", op, t) for op in ("copy", "sort") for t in (1, 2)}
    for r in rows:
        assert r["gbps"] > 0 and abs(r["efficiency"] - r["speedup"] / r["threads"]) < 1e-9


@pytest.mark.slow
def test_process_reference_rows():
    """``--procs``: the corpus in 1 and 2 processes at once (spawned, each checks its own round
    trip), rows of both ops with the speedup over one process. Slow: three fresh interpreters
    import torch (~15 s on the 2-core VM)."""
    rows = cpu_threads.process_reference("bf16-relu", 64 * 4096, 4096, [1, 2], repeats=1, seed=3)
    assert {(r["op"], r["threads"]) for r in rows} == {
        (op, t) for op in ("compress-procs", "decompress-procs") for t in (1, 2)}
    for r in rows:
        assert r["gbps"] > 0 and abs(r["efficiency"] - r["speedup"] / r["threads"]) < 1e-9
        # over the span from the first start to the last end: the seconds a call of it took
        assert r["gbps"] == pytest.approx(r["threads"] * 64 * 4096 / r["seconds"] / 1e9)
        assert r["gbps_sum_of_medians"] > 0


def test_thread_spans_time_each_threads_loop():
    """``--spans``: for each op at 2 and 3 threads, when the C loop began (the last thread's,
    with Python threads), what followed it, and its time times the threads over the one-thread
    call; the mode says which threads ran the loops; the C loops restored afterwards."""
    from bench import corpora
    from torch_pagecomp import cpu_codec

    if not cpu_codec._SHARED_RANGES:
        pytest.skip("torch_pagecomp._native is not built here")
    orig = cpu_codec._run_ranges
    pages = corpora.build_corpus("text", 256 * 4096, 4096, seed=1)
    rows = cpu_threads.thread_spans(pages, 1, [1, 2, 3], repeats=2)
    assert cpu_codec._run_ranges is orig
    assert {(r["op"], r["threads"]) for r in rows} == {
        (op, t) for op in ("compress", "decompress") for t in (2, 3)}
    for r in rows:
        assert r["calls"] == 2 and r["start_us"] >= 0 and r["tail_us"] >= 0
        assert r["mode"] == ("c" if cpu_codec._C_THREADS else "python")
        # a time ratio: only its sign and finiteness are the test's (3 threads on a loaded
        # 2-core runner inflated 20.9x once in CI; bench.cpu_threads measures it)
        assert 0 < r["inflation"] < math.inf
    doc = {"device": "CPU", "commit": "x", "date": "d", "loops": "C", "rows": [],
           "spans": [{"corpus": "text", **r} for r in rows]}
    assert "inflation" in cpu_threads.table(doc)
