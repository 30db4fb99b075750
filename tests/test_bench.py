"""The benchmark harness: a CPU smoke run whose report must be complete and correct.

No timing asserts: only that every row exists, round trips hold, ratios are plausible, and the
JSON, table and chart are written. Corpora use fresh seeds; the seed is in every message.
"""

from __future__ import annotations

import importlib.util
import json
import random
import types

import lz4.block
import pytest
import torch

from bench import __main__ as bench_main
from bench import corpora, harness, report
from bench import nvcomp as nvc
from torch_pagecomp.shuffle import bitshuffle

SMALL_MIB = "0.25"  # 64 pages of 4 KiB per corpus


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = bench_main.main(["--device", "cpu", "--mib", SMALL_MIB, "--repeats", "1", "--warmup",
                          "0", "--budget", "1", "--out", str(out)])
    with open(out / "results.json") as f:
        return rc, json.load(f), out


def _rows(rep, corpus, codec):
    return [r for r in rep["results"] if r["corpus"] == corpus and r["codec"] == codec]


def test_report_header_and_files(smoke):
    rc, rep, out = smoke
    assert rc == 0
    for key, typ in [("device", str), ("torch", str), ("triton", str), ("commit", str),
                     ("date", str), ("page_size", int), ("results", list), ("copies", list)]:
        assert isinstance(rep[key], typ), key
    assert rep["page_size"] == 4096 and rep["commit"]
    table = (out / "table.txt").read_text()
    for name in corpora.CORPORA:
        assert name in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = {c["name"] for c in rep["copies"]}
    assert {"pinned-d2h", "pinned-h2d", "d2d", "host-memcpy"} <= names


def test_every_corpus_codec_row(smoke):
    _, rep, _ = smoke
    seed = rep["seed"]
    for name, corpus in corpora.CORPORA.items():
        e = corpus.element_size
        widths = [1] if e == 1 else [1, e]
        for codec in ("pagecomp", "nvcomp"):
            got = sorted(r["element_size"] for r in _rows(rep, name, codec)
                         if "variant" not in r)
            assert got == widths, (name, codec, seed)
        floats = [r for r in _rows(rep, name, "pagecomp") if r.get("variant") == "float"]
        assert [r["element_size"] for r in floats] == ([2] if e == 2 else []), (name, seed)
        for codec in ("lz4-cpu", "lz4-cpu-mt"):
            assert len(_rows(rep, name, codec)) == 1, (name, codec, seed)
        for r in rep["results"]:
            if r["corpus"] == name:
                assert r["corpus_element_size"] == e
    for r in _rows(rep, "text", "nvcomp"):  # no CUDA here: listed, and says why
        assert r["skipped"] and r["ratio"] is None


def test_typed_rows_in_smoke(smoke):
    """Issue #23: on every bf16 corpus the typed nvCOMP rows (skipped without CUDA, with the
    reason) and ZipNN (measured or saying why not) sit beside our exponent codec; DFloat11 is
    named as not measured; the table's side-by-side block lists them."""
    _, rep, out = smoke
    seed = rep["seed"]
    table = (out / "table.txt").read_text()
    summary = table[table.index("typed codecs on the float corpora"):]
    assert "cupy" in rep["not_measured"]["dfloat11"]
    for name, corpus in corpora.CORPORA.items():
        typed = [r.get("variant") for r in _rows(rep, name, "nvcomp") if r.get("variant")]
        zipnn = _rows(rep, name, "zipnn")
        if corpus.element_size != 2:
            assert typed == [] and zipnn == [], (name, seed)
            continue
        assert typed == ["ans-fp16-4k", "ans-fp16-64k", "bitcomp-4k"], (name, seed)
        for r in _rows(rep, name, "nvcomp"):
            assert r["skipped"] and r["element_size"] == 2 or "variant" not in r, r
        assert zipnn and all(r.get("skipped") or r["roundtrip_ok"] for r in zipnn), seed
        assert name in summary.splitlines()[1]
    for lab in ("pagecomp exp-bf16", "nvcomp ans-fp16-4k", "nvcomp ans-fp16-64k",
                "nvcomp bitcomp-4k", "nvcomp lz4+bitshuffle16", "zipnn"):
        assert lab in summary, lab


def test_rows_correct_and_plausible(smoke):
    _, rep, _ = smoke
    seed = rep["seed"]
    for r in rep["results"]:
        if r.get("skipped"):
            continue
        where = (r["corpus"], r["label"], seed)
        assert r["roundtrip_ok"] is True, where
        assert r["ratio"] > 0.98 and r["compress_gbps"] > 0 and r["decompress_gbps"] > 0, where
        for key in ("ratio", "compress_gbps", "decompress_gbps", "roundtrip_ok", "codec"):
            assert key in r, where
        if r["codec"] == "pagecomp":
            check = "reference_check" if r.get("variant") == "float" else "lz4_block_check"
            assert r[check] == {"ok": True, "pages_checked": r["pages"]}, where
            assert r["backend"] == "cpu", where
            assert sum(r["page_kinds"].values()) == r["pages"], where
            assert r["checksum_gbps"] > 0 and set(r["checksum_cost"]) == {"compress",
                                                                          "decompress"}, where
    ratio = {(r["corpus"], r["label"]): r["ratio"] for r in rep["results"] if r.get("ratio")}
    for codec in ("pagecomp", "lz4-cpu"):
        assert ratio[("text", codec)] > 1.3, seed
        assert ratio[("mixed", codec)] > 1.5, seed
        assert 0.98 < ratio[("random", codec)] <= 1.0, seed
        assert ratio[("binary", codec)] > 1.05, seed
    assert ratio[("random", "pagecomp")] == 1.0  # every page stored RAW
    for name in ("gpt-act", "gpt-kv", "gpt-weights", "bf16-randn"):
        assert ratio[(name, "pagecomp e=2")] > 1.05, (name, seed)
    assert ratio[("fp32-randn", "pagecomp e=4")] > 1.02, seed
    for name in ("gpt-act", "gpt-kv", "gpt-weights", "bf16-randn", "bf16-relu", "encoder-act"):
        assert ratio[(name, "pagecomp exp-bf16")] > 1.35, (name, seed)  # 1.42 measured
    mixed = _rows(rep, "mixed", "pagecomp")[0]["page_kinds"]
    assert 0.2 < mixed["fill"] / 64 < 0.45, (mixed, seed)


def test_report_cli_rebuilds_table_and_chart(smoke, tmp_path, capsys):
    _, _, out = smoke
    args = [str(out / "results.json")]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--png", str(tmp_path / "again.png")]
    assert report.main(args) == 0
    assert "gpt-kv" in capsys.readouterr().out
    if len(args) > 1:
        assert (tmp_path / "again.png").stat().st_size > 10_000


@pytest.mark.parametrize("name", list(corpora.CORPORA))
def test_build_corpus_api(name):
    seed = random.randrange(1 << 30)
    page = random.choice([4096, 8192])
    nbytes = 5 * page + 123  # not a whole number of pages: floored
    a = corpora.build_corpus(name, nbytes, page_size=page, seed=seed)
    assert a.dtype == torch.uint8 and a.shape == (5, page) and a.is_contiguous(), seed
    assert torch.equal(a, corpora.build_corpus(name, nbytes, page_size=page, seed=seed)), seed
    b = corpora.build_corpus(name, nbytes, page_size=page, seed=seed + 1)
    assert not torch.equal(a, b), seed
    e = corpora.element_size(name)
    assert e == corpora.CORPORA[name].element_size in (1, 2, 4)
    if e > 1:
        values = a.view({2: torch.bfloat16, 4: torch.float32}[e]).float()
        assert torch.isfinite(values).all(), seed


def test_build_corpus_rejects_unknown():
    with pytest.raises(ValueError, match="unknown corpus"):
        corpora.build_corpus("nope", 4096)


def _fake_nvcomp_plan(pages: torch.Tensor, width: int):
    """An object shaped like nvcomp.LZ4Plan after compress, filled by python-lz4."""
    src = bitshuffle(pages, width) if width > 1 else pages
    blocks = [lz4.block.compress(row.numpy().tobytes(), store_size=False) for row in src]
    stride = 4096 + 4096 // 255 + 32
    out = torch.full((len(blocks), stride), 0xA5, dtype=torch.uint8)
    for i, b in enumerate(blocks):
        out[i, : len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    sizes = torch.tensor([len(b) for b in blocks], dtype=torch.int64)
    return types.SimpleNamespace(page_size=4096, bitshuffle_width=width, out=out, sizes=sizes,
                                 stride=stride)


@pytest.mark.parametrize("name,width", [("text", 1), ("gpt-kv", 2), ("fp32-randn", 4)])
def test_interop_checker(name, width):
    seed = random.randrange(1 << 30)
    pages = corpora.build_corpus(name, 24 * 4096, seed=seed)
    plan = _fake_nvcomp_plan(pages, width)
    got = harness.nvcomp_interop(plan, pages, list(range(24)))
    assert got["python_lz4_decodes"] and got["pagecomp_decoder_roundtrip"], (got, seed)
    assert got.get("python_lz4_roundtrip", got.get("bitshuffle_equals_pagecomp")), (got, seed)
    plan.out[3, 0] ^= 0xFF  # a wrong token: page 3 decodes to something else, or not at all
    got = harness.nvcomp_interop(plan, pages, list(range(24)))
    assert not (got["python_lz4_decodes"] and got.get("python_lz4_roundtrip", True)
                and got.get("bitshuffle_equals_pagecomp", True)), (got, seed)


def test_interop_records_decoder_failure(monkeypatch):
    pages = corpora.build_corpus("text", 8 * 4096)
    plan = _fake_nvcomp_plan(pages, 1)

    def broken(*args, **kwargs):
        raise RuntimeError("kernel did not compile")

    monkeypatch.setattr(harness.pc, "decompress", broken)
    got = harness.nvcomp_interop(plan, pages, list(range(8)))
    assert got["python_lz4_roundtrip"] and got["pagecomp_decoder_roundtrip"] is False
    assert "did not compile" in got["pagecomp_decoder_error"]


def test_nvcomp_optional():
    assert nvc.ctypes.sizeof(nvc.CompressOpts) == nvc.ctypes.sizeof(nvc.DecompressOpts) == 64
    lib, reason = nvc.load()
    if lib is None:
        assert "nvCOMP not found" in reason
    else:
        assert lib.version.startswith("6.")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_smoke(tmp_path):
    rc = bench_main.main(["--device", "cuda", "--mib", "2", "--repeats", "2", "--out",
                          str(tmp_path), "--corpora", "text,gpt-kv,random", "--no-png"])
    rep = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0
    for r in rep["results"]:
        assert r.get("skipped") or r["roundtrip_ok"], r
    # nvCOMP's LZ4 rows check interop with python-lz4; its typed rows (ANS, Bitcomp, LZ4 +
    # bitshuffle: a "variant") have no such format to check
    nv = [r for r in rep["results"]
          if r["codec"] == "nvcomp" and not r.get("skipped") and not r.get("variant")]
    assert nv or nvc.load()[0] is None, "nvCOMP loads but no LZ4 row ran"
    for r in nv:
        assert r["interop"]["python_lz4_decodes"], r


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_pipeline_bench_smoke(tmp_path, device):
    """The pipeline bench end to end on 2 MiB per corpus: every row bit-exact, the floors and
    ratios present (on a GPU with nvCOMP, its floor too)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from bench import pipeline_bench

    rc = pipeline_bench.main(["--device", device, "--mib", "2", "--corpora", "mixed,bf16-randn",
                              "--repeats", "1", "--out", str(tmp_path)])
    rep = json.loads((tmp_path / "pipeline_bench.json").read_text())
    assert rc == 0 and len(rep["results"]) == 2
    for r in rep["results"]:
        assert r["bit_exact"], r["corpus"]
        assert r["offload_floor_gbps"] > 0 and r["restore_floor_gbps"] > 0
        assert 1.05 < r["ratio"] < 10, (r["corpus"], r["ratio"])
        if device == "cuda" and nvc.load()[0] is not None:
            assert r["nvcomp_roundtrip_ok"] and r["offload_vs_nvcomp_floor"] > 0
    assert "nv best" in (tmp_path / "pipeline_bench.txt").read_text()
    # bf16 values go through the exponent codec, as users' bf16 tensors do (on a GPU; a CPU
    # module picks it where its C loops are SIMD); bytes through LZ4
    by = {r["corpus"]: r for r in rep["results"]}
    assert by["mixed"]["codec"] == by["mixed"]["stored_codec"] == "lz4"
    assert by["bf16-randn"]["codec"] == "exp"
    if device == "cuda":
        assert by["bf16-randn"]["stored_codec"] == "exp"
        assert by["bf16-randn"]["ratio"] > 1.3  # the exponent codec's, not LZ4's (~1.2)


def test_pipeline_bench_lz4_codec(tmp_path):
    """``--codec lz4`` offloads 16-bit corpora as bytes: LZ4 + bit-shuffle, as before."""
    from bench import pipeline_bench

    rc = pipeline_bench.main(["--device", "cpu", "--mib", "1", "--corpora", "bf16-randn",
                              "--repeats", "1", "--codec", "lz4", "--out", str(tmp_path)])
    (r,) = json.loads((tmp_path / "pipeline_bench.json").read_text())["results"]
    assert rc == 0 and r["bit_exact"] and r["codec"] == r["stored_codec"] == "lz4"


def test_offload_floor_with_raw_share():
    """The pipeline's floor when a share of pages may skip the kernel: kernel and link busy at
    once gives ``link + kernel * (1 - 1/ratio)``; bounded by the share allowed."""
    from bench.pipeline_bench import offload_floor

    k, b, r = 44.4, 55.3, 2.83
    assert offload_floor(k, b, r, 0.0) == (k, "kernel")
    gbps, kind = offload_floor(k, b, r, 1.0)
    assert kind == "split" and abs(gbps - (b + k * (1 - 1 / r))) < 1e-9
    gbps, kind = offload_floor(k, b, r, 0.2)  # 80% compressed: the kernel still bounds
    assert kind == "split" and abs(gbps - k / 0.8) < 1e-9
    assert offload_floor(200.0, b, r, 1.0) == (b * r, "copy")  # the kernel outruns the link


def test_commit_id_of_an_exported_tree_is_its_own(tmp_path, monkeypatch):
    """A tree exported for the GPU machine (``git archive`` + ``.commit``) records the commit it
    names, even inside another checkout; without one, a folder that is not a checkout's top
    level records "unknown", never an enclosing checkout's HEAD."""
    import subprocess

    monkeypatch.delenv("PAGECOMP_COMMIT", raising=False)
    outer = tmp_path / "checkout"
    tree = outer / ".snap"
    tree.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    (tree / ".commit").write_text("5c232b0\n")
    assert harness.commit_id(None, str(tree)) == "5c232b0"
    (tree / ".commit").unlink()
    assert harness.commit_id(None, str(tree)) == "unknown"
    assert harness.commit_id("abc1234", str(tree)) == "abc1234"
    monkeypatch.setenv("PAGECOMP_COMMIT", "def5678")
    assert harness.commit_id(None, str(tree)) == "def5678"
