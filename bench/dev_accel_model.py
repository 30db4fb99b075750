"""Dev estimate of the compressor's ``accel`` option from the tests' Python model of the parse.

``python3 -m bench.dev_accel_model [--pages 48]`` (CPU is enough): per corpus, a sample of pages
through ``tests/test_triton_compress._model`` with ``accel`` 0 (the default), 1, 2, 4: the
stored ratio (exact: the model writes the kernel's bytes, same page rules) and the windows
hashed per page. The compressor is bound by its hash-table operations (two L2 operations per
hashed position, ``bench/results/README.md``), so windows hashed per page stand in for its time;
the GPU speed itself needs ``bench.dev_parse_probe`` on a GPU.
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

CORPORA = ("text", "binary", "mixed", "bf16-relu", "gpt-kv", "fp32-randn", "random")
ACCELS = (0, 1, 2, 4)


def _count_windows():
    """Wrap the model's per-window candidate step with a counter; returns the counter."""
    count = [0]
    inner = T._store_cands

    def counted(*a, **k):
        count[0] += 1
        return inner(*a, **k)

    T._store_cands = counted
    return count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=48)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    count = _count_windows()
    print(f"model of the default parse (candidates {T.lc.DEFAULT_CANDIDATES}, window "
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
            _, sizes, _ = T._model(pages, e, T.WINDOW, candidates=T.lc.DEFAULT_CANDIDATES,
                                   accel=accel, min_match=T.lc.DEFAULT_MIN_MATCH)
            ratio = pages.numel() / int(sizes.sum())
            cells.append(f"{ratio:.3f}, {count[0] / pages.shape[0]:.1f}")
        print(f"| {name} | {e} | " + " | ".join(cells) + f" |  ({time.time() - t0:.0f} s)",
              flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
