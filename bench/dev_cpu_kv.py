"""Dev probe (#23, #25): a bf16 KV cache on the CPU, ``CompressedOffloadedCache(codec=...)``
with the CPU codecs' store (no Triton interpreter): host bytes held and generation time.

``python -m bench.dev_cpu_kv [--layers 4] [--prompt 1024] [--new 32] [--rounds 2]`` (CPU):
a ``LlamaForCausalLM`` with random weights in bf16 (hidden 512, 8 heads, 4 KV heads of 64),
greedy ``generate`` of ``--new`` tokens after a ``--prompt``-token prompt, with ``codec="lz4"``
and ``codec="auto"`` (the exponent codec for bf16 where the C loops are SIMD) in turn,
``--rounds`` times, every run's tokens checked against ``DynamicCache``'s. Prints per codec the
median wall time and, at the end of a run, the cache's sealed blocks' ratio and host bytes.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    import transformers as tr

    from torch_pagecomp.integrations.transformers import CompressedOffloadedCache

    torch.manual_seed(0)
    config = tr.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=a.layers,
                            num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
                            max_position_embeddings=a.prompt + a.new)
    model = tr.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, a.prompt), generator=torch.Generator()
                        .manual_seed(1))

    # transformers 5.x names the cache argument ``cache``, earlier ones ``past_key_values``
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(cache):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=a.new, min_new_tokens=a.new, **{kw: cache})
        return out, time.perf_counter() - t0

    ref, _ = run(tr.DynamicCache(config=config))
    times, st = {"lz4": [], "auto": []}, {}
    for r in range(a.rounds):
        for codec in (("lz4", "auto") if r % 2 == 0 else ("auto", "lz4")):
            cache = CompressedOffloadedCache(config=config, codec=codec)
            out, s = run(cache)
            if not torch.equal(out, ref):
                raise AssertionError(f"codec={codec}: tokens differ from DynamicCache's")
            times[codec].append(s)
            st[codec] = cache.stats()
            cache.close()
    print(f"bf16 K/V of {a.layers} layers, {a.prompt} + {a.new} tokens\n| codec | generate s "
          f"(median of {a.rounds}) | sealed blocks' ratio | host MiB |\n|---|---|---|---|")
    for codec in ("lz4", "auto"):
        print(f"| {codec} | {statistics.median(times[codec]):.3f} | {st[codec]['ratio']:.3f} | "
              f"{st[codec]['host_bytes'] / 2**20:.2f} |")


if __name__ == "__main__":
    main()
