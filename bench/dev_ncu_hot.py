"""Dev probe: where a kernel's instructions go, from ncu's per-instruction counts.

Reads the CSV that ``ncu -i REPORT --page source --print-source sass --csv`` prints for a
report taken with ``--section SourceCounters`` (plain or gzipped), and prints per warp (the
counts divided by the first instruction's, which every warp runs once): the instructions
executed, by opcode, the share of the integer ALU pipe's opcodes, and the hottest stretches
of the program (``--window`` consecutive instructions) with their opcode mix. Session 66
found this way that ``tl.histogram`` was about 640 of the exponent encoder's 1,357
instructions per warp on Triton 3.6 (a ballot per bit of the bin), which the SASS compiled on
the CPU machine (Triton 3.9: shared-memory atomics) could not show
(``bench/results/h200_session66/``).

    ncu --section SourceCounters -k regex:_exp_encode --launch-skip 1 --launch-count 1 \\
        -o enc python3 -m bench.dev_ncu_target bf16-relu --exp
    ncu -i enc.ncu-rep --page source --print-source sass --csv > enc.csv
    python -m bench.dev_ncu_hot enc.csv [--window 40]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re

# opcodes that issue to the integer ALU pipe on sm_90 (IMAD and its forms go to the FMA pipe)
ALU = frozenset({"ISETP", "SEL", "LOP3", "SHF", "PRMT", "IADD3", "LEA", "SGXT", "VIMNMX",
                 "VIMNMX3", "P2R", "R2P", "PLOP3", "FLO", "BMSK", "BREV", "IABS", "VIADD"})
_OPCODE = re.compile(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)")


def read_counts(path: str) -> list[tuple[str, str, int]]:
    """``(opcode, SASS text, warp-level executions)`` of each instruction, in program order."""
    raw = open(path, "rb").read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    rows = list(csv.reader(io.StringIO(raw.decode())))
    head = next(i for i, r in enumerate(rows) if "Instructions Executed" in r)
    cols = rows[head]
    src, ex = cols.index("Source"), cols.index("Instructions Executed")
    out = []
    for r in rows[head + 1:]:
        if len(r) <= max(src, ex):
            continue
        m = _OPCODE.match(r[src])
        out.append((m.group(1) if m else "?", r[src].strip(), int(r[ex].replace(",", "") or 0)))
    if not out or out[0][2] <= 0:
        raise ValueError(f"{path}: no executed instructions (a SourceCounters report?)")
    return out


# opcodes that mark what a stretch of the program does (a ballot, a popcount, an atomic, a
# barrier, a shuffle, shared or global memory)
MARKERS = frozenset({"VOTE", "POPC", "ATOMS", "ATOMG", "RED", "BAR", "SHFL", "REDUX", "LDS",
                     "STS", "LDG", "STG"})


def summary(counts: list[tuple[str, str, int]], window: int = 40) -> dict:
    """Per warp: ``total``, ``alu``, ``by_opcode`` (most first) and the program's ``map``:
    stretches of ``window`` instructions that ran, consecutive ones with the same marker
    opcodes (:data:`MARKERS`) joined, as ``(first index, end index, executions, on the ALU
    pipe, markers)``."""
    warps = counts[0][2]
    per = [(op, n / warps) for op, _, n in counts]
    by_op = collections.Counter()
    for op, n in per:
        by_op[op] += n
    stretches = []
    for i in range(0, len(per), window):
        part = per[i:i + window]
        n = sum(c for _, c in part)
        if n == 0:
            continue
        alu = sum(c for op, c in part if op in ALU)
        marks = tuple(sorted({op for op, c in part if c > 0 and op in MARKERS}))
        last = stretches[-1] if stretches else None
        if last and last[1] == i and last[4] == marks:
            stretches[-1] = (last[0], i + len(part), last[2] + n, last[3] + alu, marks)
        else:
            stretches.append((i, i + len(part), n, alu, marks))
    return {"warps": warps, "total": sum(by_op.values()),
            "alu": sum(n for op, n in by_op.items() if op in ALU),
            "by_opcode": by_op.most_common(), "map": stretches}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--window", type=int, default=40, help="instructions a stretch")
    args = ap.parse_args(argv)
    s = summary(read_counts(args.csv), args.window)
    print(f"{s['warps']} warps; per warp {s['total']:.0f} instructions, {s['alu']:.0f} on the "
          f"ALU pipe")
    print("  " + " ".join(f"{op} {n:.0f}" for op, n in s["by_opcode"][:16]))
    print("  instructions   executed  ALU  markers")
    for a, b, n, alu, marks in s["map"]:
        print(f"  {a:5d}-{b:<5d} {n:9.1f} {alu:5.0f}  {' '.join(marks)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
