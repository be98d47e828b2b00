from setuptools import find_packages, setup

setup(
    name="npu_pool",
    version="0.1.0",
    description="Fragmentation-aware device memory pool for large-model training (Ascend NPU, CUDA, simulated)",
    packages=find_packages(include=["npu_pool", "npu_pool.*", "mindspeed_patch", "mindspeed_patch.*"]),
    package_data={"npu_pool": ["csrc/*.c", "csrc/*.h", "shim/*.cpp"]},
    python_requires=">=3.9",
    setup_requires=["cffi>=1.15"],
    cffi_modules=["npu_pool/_build.py:ffibuilder"],
    # torch is deliberately not listed: install the build you need first (CPU: torch==2.13.0).
    install_requires=["cffi>=1.15", "pyyaml>=6", "tqdm>=4"],
    extras_require={"test": ["pytest>=7", "hypothesis>=6", "megatron-core==0.16.1"]},
    entry_points={"console_scripts": ["npu-pool=npu_pool.cli:main"]},
)
