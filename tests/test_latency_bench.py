"""``python -m bench.latency`` on the CPU at tiny sizes: the JSON has its schema and every
op/codec row, results are right, and the verdicts judge the targets as stated. No timing
asserts."""

from __future__ import annotations

import datetime
import itertools
import json

import pytest
import torch

from bench import latency

SIZES = (8 << 10, 16 << 10)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("latency") / "latency.json"
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGECOMP_COMMIT", "abc1234")
    try:
        rc = latency.main(["--device", "cpu", "--sizes", "8K,16K", "--repeats", "3",
                           "--warmup", "1", "--out", str(out)])
    finally:
        mp.undo()
    return rc, json.loads(out.read_text()), out


def test_header(run):
    rc, rep, out = run
    assert rc == 0
    dev = rep["device"]
    for key in ("name", "driver", "torch", "triton"):
        assert isinstance(dev[key], str) and dev[key], key
    assert dev["torch"] == torch.__version__
    assert rep["commit"] == "abc1234"
    assert datetime.datetime.fromisoformat(rep["date"]).tzinfo is not None
    assert isinstance(rep["rows"], list) and isinstance(rep["verdicts"], list)
    assert any("CPU run" in n for n in rep["notes"])
    table = out.with_suffix(".md").read_text()
    assert "verdicts:" in table and "offload_restore" in table


def test_every_row_and_schema(run):
    _, rep, _ = run
    rows = rep["rows"]
    for r in rows:
        assert {"op", "codec", "bytes", "host_us", "e2e_us"} <= set(r), r
        assert r["op"] in latency.OPS and r["codec"] in latency.CODECS, r
        assert isinstance(r["bytes"], int) and r["host_us"] > 0, r
        assert r["e2e_us"] == r["host_us"], r  # the CPU run has no device clock
        assert 1 <= r["calls"] <= 3, r
        assert r["ok"] in (True, None), r
    got = sorted((r["corpus"], r["bytes"], r["op"], r["codec"]) for r in rows)
    want = sorted(k for k in itertools.product(latency.DEFAULT_CORPORA, SIZES, latency.OPS,
                                               ("pagecomp", "copy"))
                  if not (k[2] in latency.OUT_OPS and k[3] == "copy"))  # ours only
    assert got == want  # nvCOMP needs CUDA: no rows, and a note says so
    for r in rows:
        if r["codec"] == "pagecomp":
            assert r["ok"] is True and r["ratio"] > 1.0, r
            assert r["element_size"] == {"bf16-relu": 2, "mixed": 1}[r["corpus"]], r


def test_verdicts_on_cpu_are_not_judged(run):
    _, rep, _ = run
    host = [v for v in rep["verdicts"] if v["target"].startswith("host time")]
    assert len(host) == 4 * len(SIZES) * len(latency.DEFAULT_CORPORA)
    assert all(v["pass"] is None and v["value"] > 0 for v in host)
    offload = [v for v in rep["verdicts"] if v["target"].startswith("offload")]
    assert len(offload) == 1 and offload[0]["value"] is None  # 1M was not among the sizes


def _row(op, codec, host, e2e, nbytes=1 << 20, corpus="mixed"):
    return {"op": op, "codec": codec, "bytes": nbytes, "host_us": host, "e2e_us": e2e,
            "corpus": corpus}


def test_verdict_logic():
    rows = [
        _row("compress", "pagecomp", 25.0, 80.0),
        _row("decompress", "pagecomp", 31.0, 60.0),
        _row("offload_restore", "pagecomp", 300.0, 190.0),
        _row("offload_restore", "copy", 10.0, 100.0),
        _row("offload_restore", "pagecomp", 300.0, 250.0, corpus="bf16-relu"),
        _row("offload_restore", "copy", 10.0, 100.0, corpus="bf16-relu"),
    ]
    got = {(v["target"].split()[4] if v["target"].startswith("host") else "offload",
            v["corpus"]): v for v in latency.verdicts(rows, cuda=True)}
    assert got[("compress", "mixed")]["pass"] is True
    assert got[("decompress", "mixed")]["pass"] is False
    assert got[("offload", "mixed")]["pass"] is True
    assert got[("offload", "mixed")]["value"] == pytest.approx(1.9)
    assert got[("offload", "bf16-relu")]["pass"] is False


@pytest.mark.parametrize("text,want", [("64K", 65536), ("1M", 1 << 20), ("16MiB", 16 << 20),
                                       ("4096", 4096), ("1.5k", 1536)])
def test_parse_size(text, want):
    assert latency.parse_size(text) == want
    assert latency.parse_sizes(f"{text},{text}") == [want, want]


def test_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        latency.parse_args(["--corpora", "nope"])
    with pytest.raises(SystemExit):
        latency.parse_args(["--sizes", "1K"])  # under one page
