"""DFloat11's ratio beside the exponent codec's, on the harness's bf16 corpora (issue #23).

``python -m bench.dfloat11_ratio --mib 4 --out bench/out/dfloat11`` (CPU; needs ``dfloat11`` and
``dahuffman`` importable, e.g. ``pip install --no-deps --target DIR dfloat11 dahuffman==0.4.2``
and ``PYTHONPATH=DIR``).

DFloat11 Huffman-codes the 8-bit exponents of a whole tensor with one table (code lengths capped
at 32 bits) and keeps each value's sign and mantissa as one byte; its GPU decoder (cupy) also
needs per-thread bit gaps and per-block output positions. Its encoder is Python on the CPU:
here it codes each corpus whole, as its ``compress_model`` codes a layer's weights, and the
ratio counts every buffer it stores (coded exponents, sign-mantissa bytes, output positions,
gaps, lookup tables). Its package imports cupy and CUDA code on import, so only its encoding
module (``dfloat11_utils``) is loaded, from the installed package's folder.

Beside it, on the same bytes: the exponent codec at 4 KiB pages (``pagecomp.compress_exp``:
uncompressed bytes / payload bytes, as the harness counts them, and with the 13 bytes of
metadata a page), and the whole tensor's exponent entropy bound ``16 / (8 + H)``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import math
import os

import torch

from bench.children import md_table, write_results

CORPORA = ("bf16-randn", "bf16-relu", "gpt-act", "gpt-kv", "gpt-weights", "encoder-act")
META_BYTES_PER_PAGE = 13  # offset int64 + size int32 + kind uint8 (the store's metadata)


def _dfloat11_utils():
    """``dfloat11.dfloat11_utils`` loaded on its own (the package's ``__init__`` needs cupy)."""
    spec = importlib.util.find_spec("dfloat11")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("dfloat11 is not importable: see this module's docstring")
    path = os.path.join(list(spec.submodule_search_locations)[0], "dfloat11_utils.py")
    mod_spec = importlib.util.spec_from_file_location("dfloat11_utils", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def dfloat11_bytes(values: torch.Tensor, utils, bytes_per_thread: int = 8,
                   threads_per_block: int = 512) -> int:
    """Bytes DFloat11 stores for ``values`` (bf16, 1-D, on the CPU), with its defaults."""
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # its tables
        # and progress bars
        _, counter = utils.get_codec(values)
        codec, _, table = utils.get_32bit_codec(counter)
        luts = utils.get_luts(table)
        encoded, other, positions, gaps, _ = utils.encode_weights(
            [values], codec, bytes_per_thread, threads_per_block)
    return sum(t.numel() * t.element_size() for t in (encoded, other, positions, gaps, luts))


def exponent_entropy(values: torch.Tensor) -> float:
    """Bits per value of the bf16 exponent plane of ``values`` (whole-tensor statistics)."""
    exp = (values.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    counts = torch.bincount(exp, minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def measure(name: str, mib: int, seed: int, utils) -> dict:
    from bench.corpora import build_corpus

    pages = build_corpus(name, mib << 20, 4096, "cpu", seed)
    values = pages.view(-1).view(torch.bfloat16)
    nbytes = pages.numel()
    df11 = dfloat11_bytes(values, utils)
    _, sizes, _ = torch.ops.pagecomp.compress_exp(pages, "bf16")
    payload = int(sizes.sum())
    h = exponent_entropy(values)
    return {"corpus": name, "bytes": nbytes, "dfloat11_ratio": nbytes / df11,
            "exp_ratio": nbytes / payload,
            "exp_ratio_with_meta": nbytes / (payload + META_BYTES_PER_PAGE * pages.shape[0]),
            "exponent_bits": h, "entropy_bound": 16 / (8 + h)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--corpora", default=",".join(CORPORA))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch_pagecomp  # noqa: F401  (registers the ops)

    utils = _dfloat11_utils()
    rows = [measure(c, args.mib, args.seed, utils) for c in args.corpora.split(",") if c]
    doc = {"device": "cpu", "commit": os.environ.get("PAGECOMP_COMMIT", "unknown"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m bench.dfloat11_ratio " + " ".join(argv or []), "rows": rows}
    text = md_table(["corpus", "MiB", "DFloat11 (whole tensor)", "exponent codec (4 KiB pages)",
                     "the same with page metadata", "exponent bits", "bound 16 / (8 + H)"],
                    [[r["corpus"], f"{r['bytes'] / 2**20:.0f}", f"{r['dfloat11_ratio']:.3f}",
                      f"{r['exp_ratio']:.3f}", f"{r['exp_ratio_with_meta']:.3f}",
                      f"{r['exponent_bits']:.2f}", f"{r['entropy_bound']:.3f}"] for r in rows])
    print(text)
    write_results(doc, args.out, text)
    return 0 if all(math.isfinite(r["dfloat11_ratio"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
