"""The metadata lives in pyproject.toml; this file adds the optional C extensions: the CPU
path's page loops (``torch_pagecomp._native``) and the activation store's driver calls
(``torch_pagecomp._queue``). Without a C compiler the build skips them: the package then
decodes on the CPU through python-lz4 and queues those calls one by one from Python (slower,
same results)."""

import os

from setuptools import Extension, setup

# the page loops start threads of their own for a call (pthreads; none on Windows)
threads = [] if os.name == "nt" else ["-pthread"]
# torch_pagecomp._queue: the activation store's CUDA driver calls, queued by one call; it
# takes the driver with dlopen (no CUDA headers needed), so POSIX only
queue = [] if os.name == "nt" else [
    Extension("torch_pagecomp._queue", ["torch_pagecomp/_queue.c"],
              extra_compile_args=["-O2"], extra_link_args=["-ldl"], optional=True)]
setup(ext_modules=[Extension("torch_pagecomp._native", ["torch_pagecomp/_native.c"],
                             extra_compile_args=["-O3", *threads], extra_link_args=threads,
                             optional=True), *queue])
