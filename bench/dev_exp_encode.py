"""Dev probe (#23): the exponent codec's kernels against other trees', on one GPU.

Times ``compress_exp_pages`` (bf16 pages, or the same values as fp16 with ``--fp16``; 4 KiB
by default; with ``--op decode`` also ``decompress_exp_into`` of the same pages, fixed
stride) of this tree (``new``) and of each of ``--trees`` (``name=path``: a copy of another
commit's, or a variant's, ``triton_kernels`` folder, imported as a package of its own) on the
bf16 corpora, the trees in a rotating order round after round, with CUDA events around
``--reps`` back-to-back launches into preallocated outputs. Prints GB/s of input bytes per
corpus and tree (median of the rounds, and the best), then whether every tree wrote the
payload, sizes and kinds that ``new`` wrote and, for encodes, each tree's ratio (a tree with
another table rule writes other pages: each tree's pages are decoded back to the input by
``new``'s decoder, or the probe stops); decodes are checked against the input, statuses 0.

    python -m bench.dev_exp_encode --trees old=/tmp/old/triton_kernels [--mib 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys

import torch

from bench.corpora import build_corpus
from bench.timing import window_seconds

BF16_CORPORA = "bf16-randn,bf16-relu,gpt-act,gpt-kv,gpt-weights,encoder-act"


def _tree_module(name: str, path: str):
    """``exp_codec`` of the ``triton_kernels`` folder at ``path``, as package ``tree_<name>``."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp()
    shutil.copytree(path, os.path.join(root, f"tree_{name}"))
    sys.path.insert(0, root)
    return importlib.import_module(f"tree_{name}.exp_codec")


def _time(fn, reps: int) -> float:
    """GPU seconds per call of ``fn`` over ``reps`` back-to-back calls, after one."""
    fn()
    return window_seconds(fn, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", required=True, help="name=path,...: other triton_kernels folders")
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--page", type=int, default=4096)
    ap.add_argument("--corpora", default=BF16_CORPORA)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--op", default="encode", help="encode, decode or encode,decode")
    ap.add_argument("--fp16", action="store_true",
                    help="the corpora's values as fp16 pages (the fp16 layout) instead of bf16")
    args = ap.parse_args(argv)
    from torch_pagecomp.kernels import exp_codec as new

    mods = {"new": new}
    for item in args.trees.split(","):
        name, path = item.split("=", 1)
        mods[name] = _tree_module(name, path)
    names = list(mods)
    print(f"{'op':<7} {'corpus':<14} " + " ".join(f"{n + ' med/best':>18}" for n in names)
          + "  same (encode: and each tree's ratio)")
    for corpus in args.corpora.split(","):
        pages = build_corpus(corpus, args.mib << 20, args.page, "cuda", seed=3)
        if args.fp16:  # the same values in fp16 (out of its range: inf, which codes as well)
            pages = pages.view(torch.bfloat16).to(torch.float16).view(torch.uint8).view(
                pages.shape)
        n = len(pages)
        outs = {k: (torch.empty_like(pages), torch.empty(n, dtype=torch.int32, device="cuda"),
                    torch.empty(n, dtype=torch.uint8, device="cuda")) for k in names}
        decoded = {k: (torch.empty_like(pages), torch.empty(n, dtype=torch.int32, device="cuda"))
                   for k in names}
        fns = {"encode": {k: functools.partial(mods[k].compress_exp_pages, pages, args.fp16,
                                               traced=False, out=outs[k]) for k in names},
               "decode": {k: functools.partial(mods[k].decompress_exp_into,
                                               outs["new"][0].view(-1), None, outs["new"][1],
                                               outs["new"][2], *decoded[k], traced=False)
                          for k in names}}
        fns["encode"]["new"]()  # the payload every decode reads
        for op in args.op.split(","):
            times: dict[str, list[float]] = {k: [] for k in names}
            for r in range(args.rounds):
                for k in names[r % len(names):] + names[:r % len(names)]:
                    times[k].append(_time(fns[op][k], args.reps))
            if op == "encode":  # each tree's pages decode back (by this tree's decoder)
                same = all(torch.equal(a, b) for k in names[1:]
                           for a, b in zip(outs["new"], outs[k]))
                for k in names[1:]:
                    out, status = decoded["new"]
                    new.decompress_exp_into(outs[k][0].view(-1), None, outs[k][1], outs[k][2],
                                            out, status, traced=False)
                    assert torch.equal(out, pages) and not status.any(), k
                same = f"{same} " + " ".join(
                    f"{pages.numel() / outs[k][1].sum().item():.4f}" for k in names)
            else:
                same = all(torch.equal(decoded[k][0], pages) and not decoded[k][1].any()
                           for k in names)
            gb = pages.numel() / 1e9
            print(f"{op:<7} {corpus:<14} " + " ".join(
                f"{gb / statistics.median(times[k]):10.0f} /{gb / min(times[k]):6.0f}"
                for k in names) + f"  {same}")
        del pages, outs, decoded
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
