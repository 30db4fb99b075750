"""Diagnostics only: PAGECOMP_DIAG picks kernel defaults before the tests import them."""
import os

_d = os.environ.get("PAGECOMP_DIAG", "")
if _d:
    import sys
    sys.path.insert(0, os.getcwd())
    from triton_kernels import lz4_compress as _c
    from triton_kernels import lz4_decompress as _d2
    if "shuffled0" in _d:
        _d2.SHUFFLED_LEAN = False
    if "lean1" in _d:
        _d2.LEAN = 1
    if "noback" in _d:
        _c.DEFAULT_BACK = False
        _c.compress_pages.__kwdefaults__["back"] = False
    if "min4" in _d:
        _c.DEFAULT_MIN_MATCH = 4
    print("PAGECOMP_DIAG", _d, _d2.SHUFFLED_LEAN, _d2.LEAN, _c.DEFAULT_BACK, _c.DEFAULT_MIN_MATCH,
          file=sys.stderr)
