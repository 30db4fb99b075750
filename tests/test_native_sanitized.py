"""The C page loops (``torch_pagecomp/_native.c``) built with AddressSanitizer and
UndefinedBehaviorSanitizer, under the tests that drive them hardest: hostile metadata, every
range taken by C threads and by Python threads sharing a counter, the exponent codec's mutation
fuzz, the LZ4 decoder's hand-made blocks (long overlapping matches at every period) and mutated
blocks. A read or write outside a buffer, a use after free or undefined behaviour in any
thread aborts the run, where the plain build could pass over it unseen. Marked slow (``make
test-slow``). Skipped where there is no C compiler with the sanitizers' runtimes (or the
extension is not built)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

from torch_pagecomp import cpu_codec

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = ("test_cpu_shared_ranges.py", "test_exp_codec_native.py", "test_codec_cpu.py")


def _runtime(name: str) -> str | None:
    """The path of the compiler's sanitizer runtime ``name`` (``libasan.so``), or None."""
    try:
        got = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return got if os.path.isabs(got) and os.path.exists(got) else None


@pytest.mark.slow  # ~30 s: a build and two test files under the sanitizers (make test-slow)
@pytest.mark.skipif(not cpu_codec._SHARED_RANGES or sys.platform != "linux",
                    reason="torch_pagecomp._native is not built here (or not on Linux)")
def test_c_loops_under_address_and_ub_sanitizers(tmp_path):
    asan, ubsan = _runtime("libasan.so"), _runtime("libubsan.so")
    if shutil.which("gcc") is None or asan is None or ubsan is None:
        pytest.skip("no gcc with the ASan / UBSan runtimes")
    # a copy of the package whose C loops are the sanitized build, and of the tests
    shutil.copytree(ROOT / "torch_pagecomp", tmp_path / "torch_pagecomp",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(ROOT / "tests", tmp_path / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    so = tmp_path / "torch_pagecomp" / f"_native{sysconfig.get_config_var('EXT_SUFFIX')}"
    build = subprocess.run(
        ["gcc", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=undefined", "-pthread", "-shared", "-fPIC",
         f"-I{sysconfig.get_paths()['include']}", str(ROOT / "torch_pagecomp" / "_native.c"),
         "-o", str(so)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(PYTHONPATH=str(tmp_path), LD_PRELOAD=f"{asan} {ubsan}",
               ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1")
    where = subprocess.run(
        [sys.executable, "-c", "import torch_pagecomp._native as n; print(n.__file__)"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert where.stdout.strip() == str(so), where
    run = subprocess.run(
        # -s: a sanitizer's report goes to the run's stderr (captured by pytest, it was lost
        # when the sanitizer ended the process)
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "not slow",
         *[str(tmp_path / "tests" / f) for f in FILES]],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    report = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, report
    assert "ERROR: AddressSanitizer" not in report and "runtime error:" not in report, report
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 20, report  # the files ran, not skipped
