"""Dev probe (#23): how many exponent-codec pages take the decoder's many-escapes path.

The GPU decoder loads a row's first two escapes once for the row, unless some row of 8
values in the step has three or more, when every escape of that step is loaded on its own
(``kernels.exp_codec._decode_step``; that path's block has about 1.7x the instructions,
``bench.dev_sass``). This codes each bf16 corpus with the CPU reference (4 KiB pages, one
step each on the GPU) and prints, per corpus, the share of EXP pages, the escapes a value,
and the share of EXP pages with a row of three or more escapes. No GPU needed.

    python -m bench.dev_escape_rows [--mib 8] [--corpora bf16-randn,...]
"""

from __future__ import annotations

import argparse

from bench.dev_exp_encode import BF16_CORPORA


def escape_rows(pages) -> tuple[float, float, float]:
    """``(EXP share, escapes a value on EXP pages, share of EXP pages with a row of 3+
    escapes)`` of ``uint8 [N, 4096]`` bf16 pages, coded by the CPU reference."""
    from torch_pagecomp import exp_codec as ec
    from torch_pagecomp import format as fmt

    n = pages.shape[1] // 2
    payload, _, kinds = ec.compress_exp_cpu(pages, fmt.EXP_BF16)
    exp = ((kinds & 15) == fmt.KIND_EXP).numpy()
    codes = ec.unpack3(payload.numpy().reshape(len(pages), -1)[:, 7:7 + 3 * n // 8])
    per_row = (codes.reshape(len(pages), n // 8, 8) == 7).sum(-1)
    if not exp.any():
        return 0.0, 0.0, 0.0
    many = (per_row > 2).any(-1)
    return (float(exp.mean()), float(per_row.sum(-1)[exp].mean() / n),
            float(many[exp].mean()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--corpora", default=BF16_CORPORA)
    args = ap.parse_args(argv)
    from bench.corpora import build_corpus

    print(f"{'corpus':<14} {'EXP pages':>9} {'escapes/value':>13} {'pages, a row of 3+':>18}")
    for name in args.corpora.split(","):
        pages = build_corpus(name, args.mib << 20, 4096, "cpu", seed=3)
        share, rate, many = escape_rows(pages)
        print(f"{name:<14} {share:9.3f} {rate:13.4f} {many:18.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
