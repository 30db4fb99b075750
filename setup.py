from setuptools import setup

setup(
    name="torch-pagecomp",
    version="0.1.0",
    description="LZ4 compression of GPU memory pages for PyTorch offload (Triton kernels)",
    packages=["torch_pagecomp", "triton_kernels", "bench"],
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "lz4>=4.0", "numpy"],
    extras_require={"gpu": ["triton>=3.2"], "dev": ["pytest", "ruff", "matplotlib"]},
)
