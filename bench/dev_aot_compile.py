"""Dev tool: compile every kernel the package launches for a GPU architecture, without a GPU.

The Triton interpreter (CI, and sessions without a GPU) runs a kernel's Python, not its
compilation: device code the compiler rejects, or a type the interpreter lets through, shows up
only on the next GPU run. This tool closes that gap on any machine with Triton's CUDA backend
installed (its ``ptxas`` ships with the wheel):

1. a child process runs the package's entry points on small CPU inputs under the interpreter
   (compress of every element size with checksums, decompress of fixed-stride and packed
   pages, the activation store's pack / restore, row-address decode of both codecs and
   checksums, the exponent codec of both layouts at 4 and 64 KiB pages, the float-codec
   probes, the two-tier exponent-code probe) and records each distinct launch: kernel,
   argument types, constexprs and launch options;
2. this process compiles each of them ahead of time for ``--arch`` (``triton.compile`` with
   ``GPUTarget("cuda", arch, 32)``) down to a cubin, and prints one line a kernel with its
   registers and spilled bytes a thread (``ptxas -v``).

Exit status 1 if any kernel fails to compile. About a minute on a 2-core machine, most of it
the interpreter. Where a launcher picks other settings for the interpreter (the decoders' step
sizes and L1 prefetch, the checksum's pages a program) the GPU's settings are compiled too.

    python -m bench.dev_aot_compile [--arch 90]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_DTYPES = {"uint8": "*u8", "int8": "*i8", "int16": "*i16", "int32": "*i32", "int64": "*i64",
           "float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}


def _signature(kernel, args: tuple, meta: dict) -> dict:
    """What ``triton.compile`` needs to rebuild a launch: argument types, constexprs, options."""
    import torch

    sig, const, opts = {}, {}, {}
    for name, a in zip(kernel.arg_names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = _DTYPES[str(a.dtype).removeprefix("torch.")]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if -(1 << 31) <= a < (1 << 31) else "i64"
        elif a is None:
            sig[name], const[name] = "constexpr", None
        else:
            sig[name] = "fp32"
    for name, value in meta.items():
        if name in kernel.arg_names:
            sig[name], const[name] = "constexpr", value
        else:
            opts[name] = value
    fn = kernel.fn
    return {"module": fn.__module__, "name": fn.__name__, "sig": sig, "const": const,
            "opts": opts}


def record(path: str) -> None:
    """Run the entry points under the interpreter; write each distinct launch to ``path``."""
    import torch

    import torch_pagecomp as pc
    from torch_pagecomp.kernels import launch as launch_mod

    seen: dict = {}
    original = launch_mod.launch

    def recording(kernel, grid, device, args, meta, traced=True):
        entry = _signature(kernel, args, meta)
        seen.setdefault(json.dumps(entry, sort_keys=True, default=str), entry)
        return original(kernel, grid, device, args, meta, traced)

    for name, mod in list(sys.modules.items()):  # the launchers hold `launch` by name
        if name.startswith("torch_pagecomp.kernels") and getattr(mod, "launch", None) is original:
            mod.launch = recording
    launch_mod.launch = recording

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (3 * 4096,), dtype=torch.uint8, generator=gen)
    for e in (1, 2, 4):
        c = pc.compress(x, element_size=e, backend="triton", checksum=True)
        pc.decompress(c, backend="triton")
        pc.decompress(pc.pack(c), backend="triton")
    for codec in ("exp-bf16", "exp-fp16"):  # one step a page, and many (64 KiB)
        for page in (4096, 65536):
            c = pc.compress(x.repeat(6)[:page], page_size=page, codec=codec, backend="triton")
            pc.decompress(c, backend="triton")
            pc.decompress(pc.pack(c), backend="triton")
    from torch_pagecomp.kernels.pack import pack_pages  # the ring's pack (the API packs
    # CPU pages on the host)

    c = pc.compress(x, backend="triton")
    pack_pages(c.payload, c.sizes, traced=False, zero_tail=False)
    _record_store(torch, gen)
    from bench import dev_float_codec as fc

    pages = x.view(-1, 4096)
    for kernel, args in ((fc._encode_kernel, (pages, torch.empty_like(pages),
                                              torch.empty(3, dtype=torch.int32))),
                         (fc._decode_kernel, (pages, torch.zeros(3, dtype=torch.int32),
                                              torch.empty_like(pages),
                                              torch.empty(3, dtype=torch.int32)))):
        entry = _signature(kernel, args, {"P": 4096, "K": fc.K, "num_warps": 4})
        seen.setdefault(json.dumps(entry, sort_keys=True, default=str), entry)
    from bench import dev_float_window as fw

    window_meta = {"P": 4096, "BINS": fw.BINS, "OFFSETS": fw.OFFSETS, "OFFSETS_P2": 16,
                   "num_warps": 4}
    for kernel, args, meta in (
            (fw._encode_kernel, (pages, torch.empty_like(pages),
                                 torch.empty(3, dtype=torch.int32)), window_meta),
            (fw._decode_kernel, (pages, torch.zeros(3, dtype=torch.int32),
                                 torch.empty_like(pages), torch.empty(3, dtype=torch.int32)),
             {"P": 4096, "num_warps": 4})):
        entry = _signature(kernel, args, meta)
        seen.setdefault(json.dumps(entry, sort_keys=True, default=str), entry)
    from bench import dev_tier_codec as tc

    sizes = torch.zeros(3, dtype=torch.int32)
    for kernel, args in ((tc._tier_encode_kernel, (pages, torch.empty_like(pages), sizes)),
                         (tc._tier_decode_kernel, (pages, sizes, torch.empty_like(pages),
                                                   torch.empty(3, dtype=torch.int32)))):
        entry = _signature(kernel, args, {"PAGE": 4096, "num_warps": 4})
        seen.setdefault(json.dumps(entry, sort_keys=True, default=str), entry)
    entries = list(seen.values())
    with open(path, "w") as f:
        json.dump(entries + _gpu_settings(entries), f)


def _gpu_settings(entries: list[dict]) -> list[dict]:
    """The GPU's variants of the kernels whose launchers pick other settings under the
    interpreter (the decoders' step sizes and L1 prefetch, the checksum's pages a program):
    each recorded launch again with the settings a GPU launch would use."""
    import dataclasses

    from torch_pagecomp.kernels import checksum, exp_codec, lz4_decompress
    from torch_pagecomp.kernels.launch import config_meta

    out = []
    for e in entries:
        page, cfg = e["const"].get("PAGE"), None
        if e["name"] == "_decompress_kernel" and not e["const"].get("ROWS"):
            cfg = lz4_decompress._configs(page, False)[0]
        elif e["name"] == "_decompress_shuffled_kernel" and not e["const"].get("ROWS"):
            cfg = lz4_decompress._configs(page, False)[1]
        elif e["name"] == "_exp_encode_kernel":
            cfg = exp_codec._encode_config(page, e["const"]["FP16"], False)
        elif e["name"] == "_exp_decode_kernel":  # both variants: rows PAGE apart, or a table
            cfg = dataclasses.replace(exp_codec._decode_config(page, False),
                                      ROWS=e["const"].get("ROWS", False))
        elif e["name"] == "page_checksum_kernel":
            cfg = dataclasses.replace(checksum.checksum_config(page, e["const"]["ROWS"]),
                                      BLOCK=16)
        if cfg is None:
            continue
        gpu = json.loads(json.dumps(e))
        for name, value in config_meta(cfg).items():
            (gpu["const"] if name in gpu["const"] else gpu["opts"])[name] = value
        if gpu != e:
            out.append(gpu)
    return out


def _record_store(torch, gen) -> None:
    """The activation store: compress + pack to the arena, restore one by one and as a group
    (row-address decode and checksums), as ``tests/test_offload_paged.py`` runs it."""
    from torch_pagecomp.offload._paged import PagedStore
    from torch_pagecomp.offload._paged_group import StoredGroup

    store = PagedStore(torch.device("cpu"), 4096, chunk_bytes=1 << 16, slice_bytes=1 << 14,
                       checksum=True)
    srcs = [torch.randint(0, 4, (n,), dtype=torch.uint8, generator=gen) for n in (3 * 4096, 8192)]
    stored = [store.offload(s, 1) for s in srcs]
    store.poll()
    store.restore(stored[0], torch.empty_like(srcs[0]))
    store.restore_group(StoredGroup(4096, stored), [torch.empty_like(s) for s in srcs])
    # the row-address decoders, called as the GPU store calls them (its CPU path decodes aside)
    import torch_pagecomp as pc
    from torch_pagecomp.kernels.exp_codec import decompress_exp_rows
    from torch_pagecomp.kernels.lz4_decompress import decompress_rows

    x = torch.randint(0, 4, (2 * 4096,), dtype=torch.uint8, generator=gen)
    out = torch.empty(2 * 4096 + 1, dtype=torch.uint8)
    rows = torch.tensor([out.data_ptr() + 1, out.data_ptr() + 4097], dtype=torch.int64)
    status = torch.empty(2, dtype=torch.int32)
    for codec, decode in (("lz4", decompress_rows), ("exp-bf16", decompress_exp_rows)):
        c = pc.compress(x, codec=codec, backend="triton")
        offsets = torch.arange(2, dtype=torch.int64) * 4096
        decode(c.payload.view(-1), offsets, c.sizes, c.kinds, rows, 4096, status)


def _resources(compiled, arch: int) -> str:
    """Registers and spilled bytes a thread, from the ptxas Triton uses (``-v``): spills are the
    first thing to look at when a kernel is slower than its memory traffic says."""
    import re

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        out = subprocess.run([get_ptxas(arch).path, "-v", f"-arch=sm_{arch}a", f.name, "-o",
                              os.devnull], capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out.stderr + out.stdout)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr + out.stdout)
    if regs is None:
        return "registers ?"
    return f"{regs.group(1)} registers, {spill.group(1) if spill else '?'} B spilled"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper)")
    ap.add_argument("--record", help=argparse.SUPPRESS)  # the child's output path
    a = ap.parse_args(argv)
    if a.record:
        record(a.record)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.json")
        # no GPU in the child, as on CI: with one visible, the entry points route CPU inputs
        # to it, where the interpreter's kernels cannot run (seen on an H200 host, session 85)
        env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        subprocess.run([sys.executable, "-m", "bench.dev_aot_compile", "--record", path],
                       env=env, check=True)
        with open(path) as f:
            launches = json.load(f)
    os.environ.pop("TRITON_INTERPRET", None)
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", a.arch, 32)
    failed = 0
    for k in launches:
        fn = getattr(importlib.import_module(k["module"]), k["name"])
        t0 = time.time()
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=k["sig"], constexprs=k["const"]),
                                      target=target, options=k["opts"])
            print(f"ok    {k['name']:32s} {time.time() - t0:5.1f} s  {_resources(compiled, a.arch)}"
                  f"  {k['const']}", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
            failed += 1
            print(f"FAIL  {k['name']:32s} {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    print(f"{len(launches) - failed} of {len(launches)} kernel variants compile for sm_{a.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
