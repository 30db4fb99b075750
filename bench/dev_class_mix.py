"""Dev probe: which saved-tensor classes a stock model's steps offload under
``prefer="memory"``, and what each compresses by.

``python3 -m bench.dev_class_mix --models encoder-1024,bert-1024`` (GPU) runs a model's SGD
step (``bench.dev_hook_timing.training_step``) under ``prefer="memory"`` (``--variants``: a
compressing variant's hooks) and counts, per ``(dtype, shape)`` class the hooks decide for
(``ClassPolicy.choose``), the saved tensors a step and their MiB a step (the bytes offered:
those then held on the GPU and read in place count too, so the stock bench's
``offloaded_bytes`` is smaller), the class's sampled ratio with each candidate codec and
whether it compresses. The last lines say what share of the offloaded bytes compresses by less
than 1.2 and 1.3: with a compressed store costing the host several times a plain copy's time
(``bench/results/h200_session76``), a class that saves few bytes may cost more step time than
the link time it saves. On five stock models on one H200 every sampled bf16 class compressed by
1.40-1.44 with the exponent codec, none below 1.3 (``bench/results/h200_session77``), so a
higher ``min_ratio`` would change nothing there; an arm that copied classes below 1.3
(``dev_ab_steps``, session 77) was removed unrun.
"""

from __future__ import annotations

import collections


def class_mix(name: str, warmup: int, steps: int, variant: str = "memory") -> str:
    """The table of :mod:`this probe <bench.dev_class_mix>` for stock model ``name`` under
    ``variant``'s hooks (a compressing one: ``memory``, ``speed``)."""
    import torch

    from bench.dev_hook_timing import training_step

    step, off = training_step(name, variant)
    counts: collections.Counter = collections.Counter()
    choose = off.policy.choose

    def counted(key, candidates=("lz4",)):
        counts[key] += 1
        return choose(key, candidates)

    try:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        off.policy.choose = counted
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        vars(off.policy).pop("choose", None)  # the class's own method again
    policy = off.policy
    lines = [f"## {name} {variant}: classes offloaded a step ({steps} steps after {warmup})",
             "| class | tensors / step | MiB / step | ratio (by codec) | compresses |",
             "|---|---|---|---|---|"]
    total = 0.0
    low = {1.2: 0.0, 1.3: 0.0}
    for key, n in sorted(counts.items(), key=lambda kv: -_mib(kv[0]) * kv[1]):
        mib = _mib(key) * n / steps
        total += mib
        ratio = policy.ratios.get(key)
        ratios = ", ".join(f"{c} {r:.3f}" for c, r in policy.codec_ratios.get(key, {}).items())
        decided = policy.decided.get(key)
        lines.append(f"| {key[0]} {list(key[1])} | {n / steps:.0f} | {mib:.1f} | {ratios or '-'} "
                     f"| {'-' if decided is None else decided} |")
        for cut in low:
            if ratio is not None and ratio < cut:
                low[cut] += mib
    lines.append(f"offloaded {total:.1f} MiB a step; " + "; ".join(
        f"below {cut}: {mib:.1f} MiB ({mib / max(total, 1e-9):.0%})" for cut, mib in low.items()))
    lines.append(f"counters a run: {dict((k, v) for k, v in off.stats().items() if k in KEYS)}")
    off.remove()
    return "\n".join(lines)


KEYS = ("offloaded_compressed", "offloaded_raw", "batched", "kept_small", "entries")


def _mib(key: tuple) -> float:
    """MiB of one tensor of class ``key`` (``(dtype, shape)``)."""
    import math

    dtype, shape = key
    return math.prod(shape) * dtype.itemsize / 2**20


def main() -> None:
    from bench.dev_hook_timing import stock_parser

    ap = stock_parser("memory")
    ap.set_defaults(models="encoder-1024,bert-1024", warmup=6, steps=3)
    a = ap.parse_args()
    for name in a.models.split(","):
        for variant in a.variants.split(","):
            print(class_mix(name, a.warmup, a.steps, variant), flush=True)


if __name__ == "__main__":
    main()
