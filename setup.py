"""The metadata lives in pyproject.toml; this file adds the optional C decoder of the CPU path
(``torch_pagecomp._native``). Without a C compiler the build skips it and the package decodes
on the CPU through python-lz4 instead (slower, same results)."""

import os

from setuptools import Extension, setup

# the page loops start threads of their own for a call (pthreads; none on Windows)
threads = [] if os.name == "nt" else ["-pthread"]
setup(ext_modules=[Extension("torch_pagecomp._native", ["torch_pagecomp/_native.c"],
                             extra_compile_args=["-O3", *threads], extra_link_args=threads,
                             optional=True)])
