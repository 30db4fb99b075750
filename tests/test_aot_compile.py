"""Every kernel the package launches compiles for Hopper (sm_90) without a GPU
(``bench/dev_aot_compile.py``). Slow (``make test-slow``): about a minute, most of it the
interpreter run that records the launches."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_every_launched_kernel_compiles_for_sm90(capsys):
    pytest.importorskip("triton.backends.nvidia")
    from bench import dev_aot_compile

    status = dev_aot_compile.main(["--arch", "90"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "FAIL" not in out and "kernel variants compile for sm_90" in out
