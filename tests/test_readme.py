"""The README's quickstart runs as written (CPU here, GPU where there is one)."""

import re
from pathlib import Path


def test_readme_quickstart_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Quickstart\s+```python\n(.*?)```", text, re.S)
    assert block, "README has no python quickstart block"
    exec(compile(block.group(1), "README quickstart", "exec"), {})
