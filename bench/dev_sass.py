"""Dev probe: a kernel's machine code for an H100 / H200 (sm_90), compiled on a machine
without a GPU.

Triton compiles ahead of time for a target it is told (``GPUTarget("cuda", 90, 32)``), with
the ``ptxas`` its wheel carries, and ``nvdisasm`` / ``cuobjdump`` from the same wheel read
the result. This prints the registers a thread, the stack (spills), the instructions by
opcode and the largest basic blocks, each with its opcodes, of the exponent codec's kernels
as their launchers set them (``decode_config`` / ``encode_config``), or of another tree's
(``--tree``: a ``triton_kernels`` folder, as ``bench.dev_exp_encode`` takes). Session 65
found the exponent decoder's rows spread over lanes this way (shuffles and shared memory
where a row was meant to stay in one thread), and counted each variant before it went to
the GPU; the counts here came within a few registers of the device's Triton 3.6
(``bench/results/h200_session65``). Instruction counts are a guide, not a speed: time on
the GPU before choosing.

It compiles with the Triton it imports (printed first). The CPU machine's 3.9 lowers some
operations otherwise than the GPU hosts' 3.6: ``tl.histogram`` to one shared-memory atomic a
value there, to a ballot a bit of the bin on 3.6, half of the exponent encoder's instructions
(session 66). For the GPU hosts' code, put 3.6 first on the path::

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python -m bench.dev_sass --kernel exp_encode

    python -m bench.dev_sass --kernel exp_decode [--page 4096] [--tree DIR] [--maxnreg 48]
        [--blocks 6] [--dump out.sass]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib
import os
import re
import subprocess
import sys
import tempfile

# each kernel: (module, kernel, pointer arguments' element types in order, other arguments)
KERNELS = {
    "exp_decode": ("exp_codec", "_exp_decode_kernel",
                   {"payload_ptr": "*u8", "offsets_ptr": "*i64", "sizes_ptr": "*i32",
                    "kinds_ptr": "*u8", "pages_ptr": "*u8", "status_ptr": "*i32",
                    "total": "i64"}),
    "exp_encode": ("exp_codec", "_exp_encode_kernel",
                   {"pages_ptr": "*u8", "payload_ptr": "*u8", "sizes_ptr": "*i32",
                    "kinds_ptr": "*u8"}),
}
_OPCODE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _module(tree: str | None, name: str):
    """``triton_kernels.<name>`` of this checkout, or of the folder ``tree``."""
    if tree is None:
        return importlib.import_module(f"torch_pagecomp.kernels.{name}")
    from bench.dev_exp_encode import _tree_module

    if name != "exp_codec":
        raise SystemExit("--tree takes the exponent codec's kernels only")
    # a package name of its own for each folder: under one name, a second tree compiled in the
    # same process would be the first one's module, as imported before
    return _tree_module("sass_" + hashlib.sha1(os.path.abspath(tree).encode()).hexdigest()[:12],
                        tree)


def compile_sass(kernel: str, page: int, tree: str | None = None, fp16: bool = False,
                 maxnreg: int | None = None) -> tuple[str, str]:
    """``(SASS text, cuobjdump's resource line)`` of ``kernel`` (a key of :data:`KERNELS`)
    for sm_90 with its launcher's settings for ``page``-byte pages."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    modname, fname, args = KERNELS[kernel]
    mod = _module(tree, modname)
    fn = getattr(mod, fname)
    if kernel == "exp_decode":
        cfg = mod._decode_config(page, False)
    else:
        cfg = mod._encode_config(page, fp16, False)
    meta = dict(cfg.meta())
    options = {"num_warps": meta.pop("num_warps")}
    cap = maxnreg if maxnreg is not None else meta.pop("maxnreg", None)
    meta.pop("maxnreg", None)
    if cap:
        options["maxnreg"] = cap
    signature = dict(args)
    signature.update({k: "constexpr" for k in meta})
    # pointers 16-byte aligned, as the package's own tensors are
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(args.values())
             if t.startswith("*")}
    src = ASTSource(fn=fn, signature=signature, constexprs=meta, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", path],
                              capture_output=True, text=True, check=True).stdout
        res = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage",
                              path], capture_output=True, text=True, check=True).stdout
    line = next((x.strip() for x in res.splitlines() if "REG:" in x), "")
    return sass, line


def opcodes(lines: list[str]) -> collections.Counter:
    """Instructions by opcode (its first word, predicated or not)."""
    ops = collections.Counter()
    for line in lines:
        m = _OPCODE.match(line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def blocks(sass: str) -> list[tuple[str, list[str]]]:
    """``(label, instruction lines)`` of each basic block, in order (a block ends at a label
    or after a branch)."""
    out: list[tuple[str, list[str]]] = [("(entry)", [])]
    for line in sass.splitlines():
        if re.match(r"^\.L\w+:", line):
            out.append((line.rstrip(":"), []))
        elif _OPCODE.match(line):
            out[-1][1].append(line)
            if re.search(r"\b(BRA|EXIT|RET)\b", line):
                out.append(("(after a branch)", []))
    return [(label, body) for label, body in out if body]


def summary(sass: str, resources: str, top: int = 6) -> str:
    """Registers and spills, instructions by opcode, and the ``top`` largest blocks."""
    rows = [resources, ""]
    every = [x for _, body in blocks(sass) for x in body]
    ops = opcodes(every)
    rows.append(f"{len(every)} instructions: "
                + " ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    rows.append("")
    ranked = sorted(blocks(sass), key=lambda b: -len(b[1]))[:top]
    for label, body in ranked:
        ops = opcodes(body)
        rows.append(f"block {label}: {len(body)} instructions: "
                    + " ".join(f"{k} {v}" for k, v in ops.most_common(10)))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="exp_decode", choices=sorted(KERNELS))
    ap.add_argument("--page", type=int, default=4096)
    ap.add_argument("--fp16", action="store_true", help="the encoder's fp16 layout")
    ap.add_argument("--tree", default=None, help="another triton_kernels folder")
    ap.add_argument("--maxnreg", type=int, default=None,
                    help="registers a thread at most (default: the launcher's)")
    ap.add_argument("--blocks", type=int, default=6, help="the largest blocks to list")
    ap.add_argument("--dump", default=None, help="write the whole SASS here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")
    sass, resources = compile_sass(args.kernel, args.page, args.tree, args.fp16, args.maxnreg)
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)
    import triton

    print(f"triton {triton.__version__}")
    print(summary(sass, resources, args.blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
