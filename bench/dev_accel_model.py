"""Dev estimate of the compressor's ``accel`` option from the tests' Python model of the parse.

``python3 -m bench.dev_accel_model [--pages 48]`` (CPU is enough): per corpus, a sample of pages
through ``tests/test_triton_compress._model`` with ``accel`` 0 (the default), 1, 2, 4: the
stored ratio (exact: the model writes the kernel's bytes, same page rules) and the windows
hashed per page. The compressor is bound by its hash-table operations (two L2 operations per
hashed position, ``bench/results/README.md``), so windows hashed per page stand in for its time;
the GPU speed itself needs ``bench.dev_parse_probe`` on a GPU.

``--probe``: for the typed corpora, the ``probe`` option (a window after a window without a
sequence hashes only its first 16 or 32 positions): ratio and positions hashed per page.

``--gate``: for the typed corpora, the window gate of ``candidates="planes"`` against
searching every window and against ``accel`` 1 without the gate (the typed default before the
gate): ratio and windows searched per page.

``--planes``: for the typed corpora, at the default parse of bit-shuffled pages, windows hashed
and matched bytes per page in each bit plane: where the remaining hashing goes, and which
planes the ratio comes from.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import test_triton_compress as T  # noqa: E402

from bench.corpora import build_corpus, element_size  # noqa: E402
from torch_pagecomp.shuffle import bitshuffle  # noqa: E402

CORPORA = ("text", "binary", "mixed", "bf16-randn", "bf16-relu", "gpt-kv", "gpt-act",
           "gpt-weights", "fp32-randn", "random")
ACCELS = (0, 1, 2, 4)


def _count(weight) -> list[int]:
    """Wrap the model's per-window candidate steps (hash table and ``"planes"``) with a counter
    that adds ``weight(span)`` per window searched; returns the counter."""
    count = [0]
    for name in ("_store_cands", "_plane_cands"):
        inner = getattr(T, name)

        def counted(span, *a, _inner=inner, **k):
            count[0] += weight(span)
            return _inner(span, *a, **k)

        setattr(T, name, counted)
    return count


def _count_windows() -> list[int]:
    return _count(lambda span: 1)


def _plane_table(name: str, pages: torch.Tensor, e: int) -> None:
    """Per bit plane: windows hashed and matched bytes per page (the typed default parse)."""
    size = pages.shape[1]
    plane = size // (8 * e)
    d = T.lc.parse_defaults(e)
    hashed = [0] * (8 * e)
    matched = [0] * (8 * e)
    inner = T._plane_cands  # the typed default: candidates="planes"

    def counted(span, *args, **kwargs):
        hashed[span[0] // plane] += 1
        return inner(span, *args, **kwargs)

    T._plane_cands = counted
    try:
        for row in bitshuffle(pages, e):
            block = T._model_block(row.numpy().tobytes(), d["window"], d["candidates"],
                                   accel=d["accel"], plane=plane)
            if len(block) > size:  # stored RAW: nothing matched
                continue
            op = 0
            for lit, _, ml in T._sequences(block, size):
                op += lit
                if ml:
                    matched[op // plane] += ml
                op += ml
    finally:
        T._plane_cands = inner
    n = pages.shape[0]
    print(f"| {name} | {e} | " + " ".join(f"{hashed[b] / n:.1f}/{matched[b] / n:.0f}"
                                          for b in range(8 * e)) + " |", flush=True)


def _count_positions() -> list[int]:
    return _count(len)


def _typed_table(pages_per_corpus: int, seed: int, modes: dict[str, dict], count: list[int],
                 unit: str) -> None:
    """Typed corpora through the model with each of ``modes`` (keywords of ``T._model``): ratio
    and ``count`` (windows or positions searched) per page."""
    print("| corpus | e | " + " | ".join(f"{m}: ratio, {unit}/page" for m in modes)
          + " |\n|---|---|" + "---|" * len(modes))
    for name in CORPORA:
        e = element_size(name)
        if e == 1:
            continue
        pages = build_corpus(name, pages_per_corpus * 4096, 4096, "cpu", seed=seed)
        cells = []
        for mode in modes.values():
            count[0] = 0
            _, sizes, _ = T._model(pages, e, None, **mode)
            ratio = pages.numel() / int(sizes.sum())
            cells.append(f"{ratio:.4f}, {count[0] / pages.shape[0]:.1f}")
        print(f"| {name} | {e} | " + " | ".join(cells) + " |", flush=True)


def _probe_table(pages_per_corpus: int, seed: int) -> None:
    """Typed corpora at the typed default parse with ``probe`` 0, 16, 32: ratio and positions
    searched per page."""
    print(f"typed default parse (window {T.lc.TYPED_WINDOW}, accel {T.lc.TYPED_ACCEL}) with "
          f"probe 0 / 16 / 32; {pages_per_corpus} pages of 4 KiB per corpus, seed {seed}")
    modes = {f"probe {p}": dict(probe=p, min_match=T.lc.DEFAULT_MIN_MATCH) for p in (0, 16, 32)}
    _typed_table(pages_per_corpus, seed, modes, _count_positions(), "positions")


def _gate_table(pages_per_corpus: int, seed: int) -> None:
    """Typed corpora, ``candidates="planes"``: ratio and windows searched per page with the gate
    (the default), without it, and without it at ``accel`` 1."""
    print(f"candidates planes, window {T.lc.TYPED_WINDOW}; {pages_per_corpus} pages of 4 KiB per "
          f"corpus, seed {seed}")
    modes = {"gate": dict(candidates="planes", gate=True, accel=0, probe=0),
             "every window": dict(candidates="planes", gate=False, accel=0, probe=0),
             "no gate, accel 1": dict(candidates="planes", gate=False, accel=1, probe=0)}
    _typed_table(pages_per_corpus, seed, modes, _count_windows(), "windows")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=48)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--planes", action="store_true", help="per bit plane, typed corpora")
    ap.add_argument("--probe", action="store_true", help="the probe option, typed corpora")
    ap.add_argument("--gate", action="store_true", help="the planes gate, typed corpora")
    a = ap.parse_args()
    if a.gate:
        _gate_table(a.pages, a.seed)
        return
    if a.probe:
        _probe_table(a.pages, a.seed)
        return
    if a.planes:
        print(f"windows hashed / matched bytes per page, bit plane 0 (least significant) first; "
              f"default typed parse; {a.pages} pages of 4 KiB per corpus, seed {a.seed}")
        print("| corpus | e | per plane |\n|---|---|---|")
        for name in CORPORA:
            e = element_size(name)
            if e > 1:
                _plane_table(name, build_corpus(name, a.pages * 4096, 4096, "cpu", seed=a.seed), e)
        return
    count = _count_windows()
    print(f"model of the default parse (candidates by element size, window "
          f"{T.WINDOW}); {a.pages} pages of 4 KiB per corpus, seed {a.seed}")
    print("| corpus | e | " + " | ".join(f"accel {x}: ratio, windows/page" for x in ACCELS) + " |")
    print("|---|---|" + "---|" * len(ACCELS))
    for name in CORPORA:
        e = element_size(name)
        pages = build_corpus(name, a.pages * 4096, 4096, "cpu", seed=a.seed)
        cells = []
        t0 = time.time()
        for accel in ACCELS:
            count[0] = 0
            _, sizes, _ = T._model(pages, e, T.WINDOW, accel=accel,
                                   min_match=T.lc.DEFAULT_MIN_MATCH)
            ratio = pages.numel() / int(sizes.sum())
            cells.append(f"{ratio:.3f}, {count[0] / pages.shape[0]:.1f}")
        print(f"| {name} | {e} | " + " | ".join(cells) + f" |  ({time.time() - t0:.0f} s)",
              flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
