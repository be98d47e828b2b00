import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from npu_pool_startup import PTH, PTH_LINE  # noqa: E402  (the start-up hook's one line)


def _write_pth(folder: str) -> None:
    """``npu_pool_startup.pth`` at the root of what becomes site-packages: Python runs its line
    at every start (``export MEMORY_FRAGMENTATION=1`` is then all a launch needs)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, PTH), "w", encoding="utf-8") as f:
        f.write(PTH_LINE)


class BuildPyWithPth(build_py):
    """Regular installs (wheel, ``pip install .``): the .pth goes beside the packages."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            _write_pth(self.build_lib)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        extra = [] if getattr(self, "editable_mode", False) else [os.path.join(self.build_lib, PTH)]
        return super().get_outputs(include_bytecode) + extra


class EditableWheelWithPth(editable_wheel):
    """Editable installs (``pip install -e .``): the editable wheel gets the .pth too."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):  # type: ignore[no-untyped-def]
        out = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        _write_pth(str(unpacked_wheel))
        return out


setup(
    name="npu_pool",
    version="0.1.0",
    description="Fragmentation-aware device memory pool for large-model training (Ascend NPU, CUDA, simulated)",
    packages=find_packages(include=["npu_pool", "npu_pool.*", "mindspeed_patch", "mindspeed_patch.*"]),
    py_modules=["npu_pool_startup"],
    package_data={"npu_pool": ["csrc/*.c", "csrc/*.h", "shim/*.cpp", "shim/*.h"]},
    python_requires=">=3.9",
    setup_requires=["cffi>=1.15"],
    cffi_modules=["npu_pool/_build.py:ffibuilder"],
    # torch is deliberately not listed: install the build you need first (CPU: torch==2.13.0).
    install_requires=["cffi>=1.15", "pyyaml>=6", "tqdm>=4"],
    extras_require={"test": ["pytest>=7", "hypothesis>=6", "megatron-core==0.16.1"]},
    entry_points={"console_scripts": ["npu-pool=npu_pool.cli:main"]},
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
)
