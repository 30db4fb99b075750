"""The ``periodic`` and ``encoder-act`` bench corpora: built as described, deterministic per
seed, compressible as expected, exact through the codec, and accepted by the harness (CPU)."""

from __future__ import annotations

import json
import random

import pytest
import torch

import torch_pagecomp as pc
from bench import __main__ as bench_main
from bench import corpora

NEW = ("periodic", "encoder-act")


@pytest.mark.parametrize("name", NEW)
def test_builds_deterministic_per_seed(name):
    seed = random.randrange(1 << 30)
    a = corpora.build_corpus(name, 6 * 4096, seed=seed)
    assert a.dtype == torch.uint8 and a.shape == (6, 4096) and a.is_contiguous(), seed
    assert torch.equal(a, corpora.build_corpus(name, 6 * 4096, seed=seed)), seed
    assert not torch.equal(a, corpora.build_corpus(name, 6 * 4096, seed=seed + 1)), seed
    assert corpora.element_size(name) == {"periodic": 1, "encoder-act": 2}[name]


@pytest.mark.parametrize("name", NEW)
def test_roundtrip_cpu(name):
    seed = random.randrange(1 << 30)
    pages = corpora.build_corpus(name, 8 * 4096, seed=seed)
    c = pc.compress(pages, element_size=corpora.element_size(name), backend="cpu")
    assert torch.equal(pc.decompress(c, backend="cpu"), pages), seed


def test_periodic_pages_repeat_a_short_pattern():
    seed = random.randrange(1 << 30)
    pages = corpora.build_corpus("periodic", 32 * 4096, seed=seed)
    start = corpora._PREFIX_MAX  # after the longest prefix every byte is in the pattern
    periods = []
    for row in pages:
        body = row[start:]
        found = [k for k in range(1, corpora._PERIOD_MAX + 1) if torch.equal(body[k:], body[:-k])]
        assert found, seed
        periods.append(found[0])
    assert len(set(periods)) > 4, (periods, seed)  # a fresh period per page
    c = pc.compress(pages, backend="cpu")
    assert c.ratio() > 20, (c.ratio(), seed)


def test_periodic_overlapping_matches_decode_with_triton():
    """python-lz4's blocks of periodic pages hold matches overlapping their own output; the
    Triton decoder (interpreted on the CPU) must copy them exactly."""
    if not (pc.gpu_status().usable or pc.backend.interpreting()):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    seed = random.randrange(1 << 30)
    pages = corpora.build_corpus("periodic", 4 * 4096, seed=seed)
    c = pc.compress(pages, backend="cpu")
    assert (c.kinds & 15 == pc.KIND_LZ4).any(), seed
    got, status = pc.decompress(c, return_status=True, backend="triton")
    assert (status == 0).all() and torch.equal(got, pages), seed


def test_encoder_act_values():
    seed = random.randrange(1 << 30)
    # Tensors come in the order saved: 1 MiB holds a whole layer's (32 tokens at the least).
    pages = corpora.build_corpus("encoder-act", 1 << 20, seed=seed)
    values = pages.view(torch.bfloat16).float()
    assert torch.isfinite(values).all(), seed
    assert values.abs().max() > 0.5 and values.std() > 0.1, seed
    # The feed-forward ReLU outputs are a third of what is saved, about half of them zero.
    zeros = (values == 0).float().mean().item()
    assert 0.05 < zeros < 0.4, (zeros, seed)
    c = pc.compress(pages, element_size=2, backend="cpu")
    assert 1.1 < c.ratio() < 2.0, (c.ratio(), seed)


def test_encoder_model_layers_differ():
    _, model = corpora._encoder_model(0)
    w = [layer.linear1.weight for layer in model.layers]
    assert len(w) == corpora.ENCODER_LAYERS and not torch.equal(w[0], w[1])
    assert model.layers[0].norm_first


def test_harness_accepts_new_corpora(tmp_path):
    rc = bench_main.main(["--device", "cpu", "--corpora", ",".join(NEW), "--mib", "0.0625",
                          "--codecs", "pagecomp,lz4-cpu", "--repeats", "1", "--warmup", "0",
                          "--budget", "1", "--out", str(tmp_path), "--no-png"])
    rep = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0
    rows = {(r["corpus"], r["label"]): r for r in rep["results"]}
    for key in [("periodic", "pagecomp"), ("periodic", "lz4-cpu"), ("encoder-act", "pagecomp"),
                ("encoder-act", "pagecomp e=2"), ("encoder-act", "lz4-cpu")]:
        assert rows[key]["roundtrip_ok"] is True, (key, rep["seed"])
    assert rows[("periodic", "pagecomp")]["ratio"] > 20, rep["seed"]
    assert rows[("encoder-act", "pagecomp e=2")]["ratio"] > 1.1, rep["seed"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NEW)
def test_builds_on_cuda(name):
    seed = random.randrange(1 << 30)
    a = corpora.build_corpus(name, 64 * 4096, device="cuda", seed=seed)
    assert a.is_cuda and a.shape == (64, 4096), seed
    assert torch.equal(a, corpora.build_corpus(name, 64 * 4096, device="cuda", seed=seed)), seed
    if name == "periodic":  # integer gathers of CPU draws: the same bytes on every device
        assert torch.equal(a.cpu(), corpora.build_corpus(name, 64 * 4096, seed=seed)), seed
    c = pc.compress(a, element_size=corpora.element_size(name))
    assert torch.equal(pc.decompress(c), a), seed
