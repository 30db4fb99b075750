"""The metadata lives in pyproject.toml; this file adds the optional C decoder of the CPU path
(``torch_pagecomp._native``). Without a C compiler the build skips it and the package decodes
on the CPU through python-lz4 instead (slower, same results)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("torch_pagecomp._native", ["torch_pagecomp/_native.c"],
                             extra_compile_args=["-O3"], optional=True)])
