"""Benchmarks whose rows each run in a fresh child process (their own CUDA context, pools and
kernel caches: no row inherits another's warm state), written as JSON plus a Markdown table."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def cell(value: float | None, places: int = 2) -> str:
    """A table cell: ``value`` to ``places`` decimals, empty when absent."""
    return "" if value is None else f"{value:.{places}f}"


def md_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header, its rule, one line per row of cells (a short row, e.g.
    an error, is padded with empty cells)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r + [""] * (len(head) - len(r))) + " |" for r in rows]
    return "\n".join(lines)


def run_child(module: str, args: list[str], row: dict, timeout: float,
              env: dict | None = None, cwd: str | None = None) -> dict:
    """``python -m module *args``; its last stdout line is its row (JSON), returned with the
    exit code and the stderr tail. A child that times out, fails or prints no row gives
    ``row`` with ``"error"`` (and the stderr tail)."""
    cmd = [sys.executable, "-m", module, *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=cwd)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timeout after {timeout} s"}
    last = r.stdout.strip().splitlines()[-1:] or [""]
    if r.returncode != 0 or not last[0].startswith("{"):
        return {**row, "error": f"exit {r.returncode}", "stderr": r.stderr[-2000:]}
    out = json.loads(last[0])
    out["exit_code"], out["stderr"] = r.returncode, r.stderr[-500:]
    return out


def write_results(doc: dict, path: str | None, table: str) -> None:
    """``doc`` as JSON at ``path`` and ``table`` beside it (same stem, ``.md``); nothing
    without a path."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as fh:
        fh.write(table + "\n")
