"""moonep_ops: perfectly load-balanced Mixture-of-Experts expert parallelism for PyTorch.

The Python package installs anywhere torch 2.11-2.14 runs.  CUDA code is *not* built here:
the GPU kernels live in a separate shared library with a plain C ABI (see docs/build.md),
built on demand by ``python -m moonep_ops.build`` on a CUDA machine.  So ``pip install`` on a
CPU-only box never invokes nvcc, even when nvcc is on PATH, and never pulls a CUDA torch.
"""
from setuptools import find_packages, setup

setup(
    name="moonep_ops",
    version="0.2.0",
    description="MoonEP-style expert parallelism with perfect load balance, as torch custom ops",
    long_description=__doc__,
    packages=find_packages(include=["moonep_ops", "moonep_ops.*"]),   # apps/ stays outside
    python_requires=">=3.10",
    # Upper bound keeps pip from resolving a newer (CUDA, multi-GB) torch on CPU machines.
    install_requires=["torch>=2.11,<2.15", "numpy"],
    extras_require={
        # Everything a test imports (+ Debian chromium, chromium-driver for the browser test).
        # transformers is pinned: the Hugging Face integration is tested against that version.
        # scipy: the grouped-GEMM cost model's fit (benchmarks/fit_gemm_cost_model.py).
        "test": ["pytest", "expecttest", "selenium", "scipy", "transformers==5.24.0", "safetensors"],
        "demo": ["matplotlib", "tqdm"],                  # the main job's plots and progress bar
        "gpu": ["triton", "nvidia-cutlass", "cuda-python"],
    },
    include_package_data=True,
    # lib/*.so: the built CUDA libraries; gemm/*.json: the cost models' fitted constants
    package_data={"moonep_ops": ["lib/*.so", "gemm/*.json"]},
)
