"""Every kernel the package launches compiles for Hopper (sm_90) without a GPU
(``bench/dev_aot_compile.py``). Slow (``make test-slow``): about a minute and a half, most of it
the interpreter run that records the launches.

The tool runs in a process of its own: in the test process the kernels were made under the
interpreter (``conftest`` sets ``TRITON_INTERPRET=1`` before they are imported), which the
compiler cannot take, and the tool clears ``TRITON_INTERPRET`` in its process, which would
leave the tests after this one running kernels outside the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_every_launched_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-m", "bench.dev_aot_compile", "--arch", "90"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "FAIL" not in out and "kernel variants compile for sm_90" in out
