"""Dev probe (#23, #25): which codec a CPU ``PageCompressor(codec="auto")`` should take for
16-bit floats: ``offload`` + ``restore`` time and stored ratio with ``codec="lz4"`` (LZ4 +
bit-shuffle) and ``codec="exp"`` (the exponent codec), alternated.

``python -m bench.dev_cpu_auto [--mib 1,16] [--rounds 2] [--repeats 12]`` (CPU; torch on one
thread, the codec's default threads): per size, corpus and dtype, each codec ``--rounds``
times in turn, each round the median of ``--repeats`` offload + restore pairs (after two
untimed ones), every restore checked bit for bit. bf16: the harness's bf16 corpora; fp16: the
same values in fp16 (``gpt-act`` as fp16 keeps bf16's zero low mantissa bits, which LZ4 +
bit-shuffle codes) and ``fp16-randn`` (full mantissas)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.corpora import build_corpus
from torch_pagecomp import PageCompressor


def _tensor(corpus: str, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    if corpus == "fp16-randn":
        g = torch.Generator().manual_seed(1)
        return (torch.randn(nbytes // 2, generator=g) * 0.02).to(torch.float16)
    x = build_corpus(corpus, nbytes, 4096, "cpu", seed=1).reshape(-1).view(torch.bfloat16)
    return x if dtype == torch.bfloat16 else x.to(dtype)


def pair_ms(x: torch.Tensor, codec: str, repeats: int) -> tuple[float, float]:
    """Median ms of one ``offload`` + ``restore`` of ``x`` and the stored ratio."""
    with PageCompressor(device="cpu", codec=codec) as pc:
        times = []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            y = pc.restore(pc.offload(x))
            if i >= 2:
                times.append(time.perf_counter() - t0)
            if not torch.equal(y.view(torch.uint8), x.view(torch.uint8)):
                raise AssertionError(f"{codec}: the restore differs")
        return statistics.median(times) * 1e3, pc.stats()["ratio"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", default="1,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=12)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cases = [(c, torch.bfloat16) for c in ("bf16-relu", "gpt-act", "gpt-kv", "gpt-weights")]
    cases += [("gpt-act", torch.float16), ("fp16-randn", torch.float16)]
    print("| MiB | corpus | dtype | lz4 ms (rounds) | exp ms (rounds) | exp / lz4 | lz4 ratio "
          "| exp ratio |\n|---|---|---|---|---|---|---|---|")
    for mib in (int(m) for m in a.mib.split(",")):
        for corpus, dtype in cases:
            x = _tensor(corpus, mib << 20, dtype)
            ms = {"lz4": [], "exp": []}
            ratio = {}
            for r in range(a.rounds):
                for codec in (("lz4", "exp") if r % 2 == 0 else ("exp", "lz4")):
                    t, ratio[codec] = pair_ms(x, codec, a.repeats)
                    ms[codec].append(t)
            lz4, exp = statistics.median(ms["lz4"]), statistics.median(ms["exp"])
            print(f"| {mib} | {corpus} | {str(dtype)[6:]} | "
                  f"{lz4:.2f} ({', '.join(f'{t:.2f}' for t in ms['lz4'])}) | "
                  f"{exp:.2f} ({', '.join(f'{t:.2f}' for t in ms['exp'])}) | {exp / lz4:.2f} | "
                  f"{ratio['lz4']:.3f} | {ratio['exp']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
