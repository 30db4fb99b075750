"""The harness's typed-codec rows (issue #23): nvCOMP ANS / Bitcomp and ZipNN beside our
exponent codec, on the CPU.

nvCOMP cannot run here: its plans are replaced by a CPU fake built on the real
:class:`bench.nvcomp.ChunkPlan` (same buffers, same round-trip check, zlib in place of the GPU
kernels), and an nvCOMP lacking an algorithm by a fake library whose ``bind`` refuses it. Where
``libnvcomp.so.6`` loads (``$NVCOMP_LIB``, or its wheel), its host-side queries check the real
options structs. ZipNN rows run where ``import zipnn`` works.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from bench import corpora, harness, report
from bench import nvcomp as nvc


def _cfg(**kw) -> harness.Config:
    base = dict(device="cpu", mib=0.25, repeats=1, warmup=0, budget_s=1.0,
                codecs=["pagecomp", "nvcomp"])
    return harness.Config(**{**base, **kw})


def _pages(name: str, n: int = 48):
    seed = random.randrange(1 << 30)
    return corpora.build_corpus(name, n * 4096, seed=seed), seed


class FakeNv:
    """An nvCOMP whose library lacks every algorithm named in ``missing``."""

    version = "6.0.0-fake"

    def __init__(self, missing=("LZ4", "ANS", "Bitcomp")):
        self.missing = set(missing)

    def bind(self, algo):
        if algo in self.missing:
            raise nvc.Unavailable(f"nvcompBatched{algo}CompressAsync is not in the fake library")
        raise AssertionError("the fake binds nothing")


class ZlibPlan(nvc.ChunkPlan):
    """The real ChunkPlan's buffers and checks, chunks coded by zlib on the CPU."""

    def __init__(self, nv, pages, variant, corrupt=False):
        self.nv, self.pages, self.algo = nv, pages, variant.algo
        self.copts, _ = variant.options()
        n_pages, p = pages.shape
        total, chunk = n_pages * p, variant.chunk_bytes
        self.n, self.page_size, self.chunk_bytes = -(-total // chunk), p, chunk
        self.stride = chunk + chunk // 100 + 64
        self.in_bytes = torch.full((self.n,), chunk, dtype=torch.int64)
        self.in_bytes[-1] = total - (self.n - 1) * chunk
        self.out = torch.zeros((self.n, self.stride), dtype=torch.uint8)
        self.sizes = torch.zeros(self.n, dtype=torch.int64)
        self.cstatus = torch.full((self.n,), -1, dtype=torch.int32)
        self.result = torch.empty_like(pages)
        self.result_bytes = torch.zeros(self.n, dtype=torch.int64)
        self.dstatus = torch.full((self.n,), -1, dtype=torch.int32)
        self.corrupt = corrupt

    def compress(self):
        flat = self.pages.view(-1)
        for i in range(self.n):
            lo = i * self.chunk_bytes
            blob = zlib.compress(flat[lo : lo + int(self.in_bytes[i])].numpy().tobytes(), 1)
            self.out[i, : len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            self.sizes[i] = len(blob)
            self.cstatus[i] = nvc.SUCCESS

    def decompress(self, src_ptrs=None):
        flat = self.result.view(-1)
        for i in range(self.n):
            raw = zlib.decompress(self.out[i, : int(self.sizes[i])].numpy().tobytes())
            lo = i * self.chunk_bytes
            flat[lo : lo + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            self.result_bytes[i] = len(raw)
            self.dstatus[i] = nvc.SUCCESS
        if self.corrupt:
            flat[5] ^= 1


def test_typed_variants_named():
    names = [v.name for v in nvc.typed_variants(2)]
    assert names == ["ans-fp16-4k", "ans-fp16-64k", "bitcomp-4k"]
    assert nvc.typed_variants(1) == [] and nvc.typed_variants(4) == []
    assert [v.name for v in nvc.typed_variants(2, 8192)][0] == "ans-fp16-8k"
    by = {v.name: v for v in nvc.typed_variants(2)}
    c, d = by["ans-fp16-4k"].options()
    assert (c.type, c.data_type, d.data_type) == (nvc.ANS_RANS, nvc.TYPE_FLOAT16,
                                                  nvc.TYPE_FLOAT16)
    assert by["ans-fp16-64k"].chunk_bytes == 65536
    c, d = by["bitcomp-4k"].options()
    assert (c.algorithm, c.data_type, c.mode) == (0, nvc.TYPE_USHORT, nvc.BITCOMP_LOSSLESS)
    for pair in nvc.OPTIONS.values():
        assert [nvc.ctypes.sizeof(t) for t in pair] == [64, 64]
    assert nvc.ctypes.sizeof(nvc.BitcompCompressOpts) == 64
    assert nvc.BitcompCompressOpts.mode.offset == 16  # after the 8-byte aligned double


def test_unavailable_algorithm_is_recorded_not_raised():
    """An nvCOMP without these algorithms: every nvCOMP row says why, the rest run."""
    pages, seed = _pages("gpt-kv")
    rows = harness.corpus_rows("gpt-kv", pages, _cfg(), FakeNv(), "", list(range(48)))
    nv_rows = [r for r in rows if r["codec"] == "nvcomp"]
    assert [r.get("variant") for r in nv_rows] == [None, None, "ans-fp16-4k", "ans-fp16-64k",
                                                   "bitcomp-4k"], seed
    for r in nv_rows:
        assert "not in the fake library" in r["skipped"] and r["roundtrip_ok"] is None, r
        assert "error" not in r
    ours = [r for r in rows if r["codec"] == "pagecomp"]
    assert len(ours) == 3 and all(r["roundtrip_ok"] for r in ours), seed


def test_typed_rows_with_fake_plans(monkeypatch):
    """ANS rows measured through the harness's own path (fake kernels), Bitcomp refused by
    this nvCOMP: recorded as skipped with the reason; the table and vs_typed show them."""
    pages, seed = _pages("gpt-act")

    def make_plan(nv, pages, variant):
        if variant.algo == "Bitcomp":
            raise nvc.Unavailable("nvCOMP 6.0.0-fake Bitcomp refused data_type=USHORT")
        return ZlibPlan(nv, pages, variant)

    monkeypatch.setattr(harness.nvc, "make_plan", make_plan)
    cfg = _cfg()
    rows = harness.corpus_rows("gpt-act", pages, cfg, FakeNv(), "", list(range(48)))
    harness.add_comparisons(rows)
    by = {r["label"]: r for r in rows}
    for name, chunks in (("ans-fp16-4k", 48), ("ans-fp16-64k", 3)):
        r = by[f"nvcomp {name}"]
        assert r["roundtrip_ok"] is True and r["ratio"] > 1.0, (r, seed)
        assert r["chunks"] == chunks and r["algorithm"] == "ANS", r
        assert r["data_type"] == "FLOAT16" and r["stored_bytes"] == int(
            48 * 4096 / r["ratio"] + 0.5)
        assert r["compress_gbps"] > 0 and r["decompress_gbps"] > 0
        assert r["codec"] == "nvcomp" and r["variant"] == name and r["element_size"] == 2
    skipped = by["nvcomp bitcomp-4k"]
    assert "refused" in skipped["skipped"] and skipped["ratio"] is None
    ours = by["pagecomp exp-bf16"]
    assert set(ours["vs_typed"]) == {"nvcomp ans-fp16-4k", "nvcomp ans-fp16-64k"}, seed
    vs = ours["vs_typed"]["nvcomp ans-fp16-4k"]
    assert abs(vs["ratio"] - ours["ratio"] / by["nvcomp ans-fp16-4k"]["ratio"]) < 1e-12
    assert "vs_nvcomp" not in ours  # LZ4 + bit-shuffle unavailable here: nothing to divide by
    for r in rows:
        r["corpus_element_size"] = 2
    table = report.format_table({"results": rows, "complete": True})
    summary = table[table.index("typed codecs on the float corpora"):]
    for lab in ("pagecomp exp-bf16", "nvcomp ans-fp16-4k", "nvcomp ans-fp16-64k",
                "nvcomp bitcomp-4k"):
        assert lab in summary, summary
    bitcomp = [ln for ln in summary.splitlines() if ln.startswith("nvcomp bitcomp-4k")]
    assert len(bitcomp) == 1 and bitcomp[0].split()[-1] == "skipped", summary
    assert "ANS FLOAT16 3 chunks of 65536 B" in table


def test_typed_round_trip_is_checked(monkeypatch):
    """A decode that differs by one bit is a failed row, not a pass."""
    pages, seed = _pages("bf16-randn", 16)
    monkeypatch.setattr(harness.nvc, "make_plan",
                        lambda nv, pages, v: ZlibPlan(nv, pages, v, corrupt=True))
    rows = harness.corpus_rows("bf16-randn", pages, _cfg(codecs=["nvcomp"]),
                               FakeNv(missing={"LZ4"}), "", list(range(16)))
    typed = [r for r in rows if r.get("variant")]
    assert len(typed) == 3 and all(r["roundtrip_ok"] is False for r in typed), seed


def test_no_typed_rows_on_byte_corpora():
    pages, _ = _pages("text", 8)
    rows = harness.corpus_rows("text", pages, _cfg(codecs=["nvcomp", "zipnn"]), None,
                               "nvCOMP not found", list(range(8)))
    assert [(r["codec"], r.get("variant")) for r in rows] == [("nvcomp", None)]


def test_nvcomp_absent_skips_typed_rows_with_reason():
    pages, _ = _pages("gpt-weights", 8)
    rows = harness.corpus_rows("gpt-weights", pages, _cfg(codecs=["nvcomp"]), None,
                               "nvCOMP not found (test)", list(range(8)))
    assert len(rows) == 5
    assert all(r["skipped"] == "nvCOMP not found (test)" for r in rows)


def _real_nvcomp():
    nv, why = nvc.load()
    if nv is None:
        pytest.skip(f"libnvcomp.so.6 not loadable here: {why[:80]}")
    return nv


def test_real_nvcomp_accepts_the_typed_options():
    """The real library's host-side queries (no GPU needed) take every variant's options
    structs, and refuse a type ANS does not have, which the plan reports as Unavailable."""
    nv = _real_nvcomp()
    pages = torch.zeros((40, 4096), dtype=torch.uint8)
    for v in nvc.typed_variants(2):
        plan = nvc.make_plan(nv, pages, v)
        assert plan.n == -(-40 * 4096 // v.chunk_bytes), v
        assert int(plan.in_bytes.sum()) == 40 * 4096
        assert plan.stride >= v.chunk_bytes and plan.stride % 16 == 0, (v, plan.stride)
        assert plan.describe()["algorithm"] == v.algo
    for width in (1, 2, 4):
        plan = nvc.LZ4Plan(nv, pages, width)
        assert plan.n == 40 and plan.page_size == 4096 and plan.stride >= 4096
    bad = nvc.Variant("ans-u16", "ANS", 4096, nvc.TYPE_USHORT, "")
    with pytest.raises(nvc.Unavailable, match="NotSupported"):
        nvc.make_plan(nv, pages, bad)
    with pytest.raises(nvc.Unavailable):
        nv.bind("NoSuchAlgo")


# ----------------------------------------------------------------------------- ZipNN
def test_zipnn_absent_is_one_recorded_row(monkeypatch):
    monkeypatch.setattr(harness, "zipnn_status", lambda: (None, "zipnn is not installed (t)"))
    pages, _ = _pages("gpt-kv", 8)
    rows = harness.corpus_rows("gpt-kv", pages, _cfg(codecs=["zipnn"]), None, "", [])
    assert len(rows) == 1 and rows[0]["codec"] == "zipnn"
    assert rows[0]["skipped"] == "zipnn is not installed (t)" and rows[0]["label"] == "zipnn"


def test_zipnn_rows():
    zn, info = harness.zipnn_status()
    if zn is None:
        pytest.skip(info)
    pages, seed = _pages("gpt-kv", 96)
    before = pages.clone()
    rows = harness.corpus_rows("gpt-kv", pages, _cfg(codecs=["zipnn"], repeats=2, warmup=1),
                               None, "", [])
    assert [r["variant"] for r in rows] == ["bf16-256k", "bf16-4k"], seed
    for r in rows:
        assert r["roundtrip_ok"] is True, (r, seed)
        assert 1.3 < r["ratio"] < 1.7, (r["ratio"], seed)  # ~1.5 measured
        assert r["compress_gbps"] > 0 and r["decompress_gbps"] > 0
        assert r["zipnn_version"] == info and r["threads"] >= 1
        assert len(r["compress_s"]) == 2
    assert [r["chunk_bytes"] for r in rows] == [256 * 1024, 4096]
    assert torch.equal(pages, before), seed  # its in-place reorder hit only our copies
