"""The machine-code probe (``bench/dev_sass.py``): on a machine without a GPU it compiles the
exponent decoder for sm_90 with its launcher's settings (the register cap included), and its
block split accounts for every instruction."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tools() -> bool:
    try:
        import triton
    except ImportError:
        return False
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(bindir, t)) for t in ("ptxas", "nvdisasm",
                                                                  "cuobjdump"))


@pytest.mark.skipif(not _tools(), reason="Triton's wheel has no ptxas / nvdisasm / cuobjdump")
def test_sass_of_the_exponent_decoder(tmp_path):
    from bench.dev_sass import blocks, opcodes

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # (the interpreter's kernels cannot be compiled)
    dump = tmp_path / "decode.sass"
    run = subprocess.run([sys.executable, "-m", "bench.dev_sass", "--kernel", "exp_decode",
                          "--dump", str(dump)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    regs = int(re.search(r"REG:(\d+)", run.stdout).group(1))
    assert 0 < regs <= 48  # the launcher's maxnreg reached the compiler
    sass = dump.read_text()
    every = sum(opcodes(sass.splitlines()).values())
    assert every > 100 and sum(len(body) for _, body in blocks(sass)) == every
    assert f"{every} instructions:" in run.stdout
    assert "STG" in sass  # the decoder stores its pages
