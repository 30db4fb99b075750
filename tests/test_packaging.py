"""The distribution: one top-level package, kernels that import nothing above them, a silent
import without Triton."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "triton_kernels"


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(0, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or ""))
    return out


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_nothing_above_them(path):
    """A kernel module may import torch, triton, the standard library and its siblings in the
    kernels package, never the API, the pipeline or the hooks."""
    for level, name in _imports(path):
        assert level <= 1, f"{path.name} imports from above the kernels package: {name}"
        if level == 0:
            assert not name.startswith("torch_pagecomp"), f"{path.name} imports {name}"


def test_wheel_installs_one_top_level_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("torch_pagecomp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"torch_pagecomp"}, top
    assert "torch_pagecomp/kernels/lz4_compress.py" in names
    assert "torch_pagecomp/integrations/transformers.py" in names
    assert "torch_pagecomp/py.typed" in names
    assert not any(n.startswith(("bench/", "tests/", "triton_kernels/")) for n in names)


def test_import_without_triton_is_silent():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, torch_pagecomp as pc\n"
        "x = torch.randint(0, 4, (3, 4096), dtype=torch.uint8)\n"
        "assert torch.equal(pc.decompress(pc.compress(x)), x)\n"
        "assert not pc.gpu_status().usable\n"
        "print(pc.__version__)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    import torch_pagecomp

    assert r.stdout.strip() == torch_pagecomp.__version__


def test_import_registers_the_ops_without_importing_dynamo():
    """``import torch_pagecomp`` registers every public op through ``triton_op`` (with Triton
    installed) while skipping torch's scan of each op's source for kernels, which imported
    Dynamo (~2.7 s of a 6.7 s import on a 2-core VM) and found none in ours; the scan is left
    in place for everyone else."""
    triton_present = importlib.util.find_spec("triton") is not None
    code = (
        "import sys, torch, torch_pagecomp\n"
        "ops = ('compress', 'decompress', 'pack', 'checksum', 'compress_exp', 'decompress_exp')\n"
        "assert all(hasattr(torch.ops.pagecomp, o) for o in ops)\n"
        "import torch._library.triton as t\n"
        "scan = getattr(t, 'get_inner_triton_kernels', None)\n"
        "if scan is not None and " + repr(triton_present) + ":\n"
        "    assert 'torch._dynamo' not in sys.modules, 'Dynamo imported'\n"
        "    assert scan.__module__ == 'torch._library.triton', scan\n"
        "    assert all(t.triton_ops_to_kernels.get(f'pagecomp::{o}') == [] for o in ops)\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
