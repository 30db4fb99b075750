"""Dev trace of the offload pipeline's threads against the GPU (GPU only).

``python3 -m bench.dev_offload_trace [--corpus bf16-randn] [--mib 1024] [--raw-share 0]``
offloads the corpus a few times, then prints the last offload's batches: GPU stage times (CUDA
events) beside the host times of the three threads (caller ``sub``mitted, issuer ``iss``ued the
download, completer ``seen`` it complete), host clock shifted so its first submit meets the
GPU's first upload; then cProfile's top functions of the caller's thread over one offload.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.corpora import build_corpus, element_size
from bench.dev_host_profile import profile_calls
from torch_pagecomp import PageCompressor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="bf16-randn")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--raw-share", type=float, default=0.0)
    ap.add_argument("--slots", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = build_corpus(a.corpus, a.mib << 20, 4096, dev, seed=5)
    es = element_size(a.corpus)
    pc = PageCompressor(device=dev, max_raw_share=a.raw_share, slots=a.slots)
    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = pc.offload(x, element_size=es)
        h.wait()
        walls.append((time.perf_counter() - t0) * 1e3)
        h.free()
    pc.reset_timing()
    h = pc.offload(x, element_size=es)
    h.wait()
    h.free()
    time.sleep(0.05)
    tl = sorted((t for t in pc.timeline() if t["kind"] == "offload"), key=lambda t: t["submitted"])
    g0, h0 = tl[0]["upload"][0], tl[0]["submitted"]
    print(f"{a.corpus} {a.mib} MiB raw_share {a.raw_share} slots {a.slots}: offload ms "
          + " ".join(f"{w:.1f}" for w in walls))
    print("slot   MiB ratio |    sub   up_s    k_s    k_e |    iss    d_s    d_e |   seen")
    for t in tl:
        def g(v):
            return f"{v - g0:6.2f}"

        def hh(v):
            return f"{v - h0:6.2f}" if v >= 0 else "     -"
        print(f"{t['slot']:4d} {t['nbytes'] / 2**20:5.1f} {t['ratio']:5.2f} | {hh(t['submitted'])} "
              f"{g(t['upload'][0])} {g(t['kernel'][0])} {g(t['kernel'][1])} | {hh(t['issued'])} "
              f"{g(t['download'][0])} {g(t['download'][1])} | {hh(t['noticed'])}")
    print(profile_calls(lambda: pc.offload(x, element_size=es).wait(), 1, 25))


if __name__ == "__main__":
    main()
