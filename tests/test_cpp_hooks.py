"""The C++ malloc hook of torch's CUDAPluggableAllocator (shim/torch_cuda_hooks.cpp, built by
npu_pool.cpp_hooks): a request the core refuses for lack of memory must raise
c10::OutOfMemoryError (torch.OutOfMemoryError), any other refusal a c10::Error. torch does not
check a NULL from the C hook: measured on an H100 (docs/gpu.md), torch.empty() then returned a
tensor without memory. Built here against the CPU torch's headers and driven by a small C++
program over fake core entry points (tests/c/malloc_hook_driver.cpp)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from npu_pool import cpp_hooks
from conftest import unavailable

HERE = Path(__file__).resolve().parent


def test_cuda_malloc_hook_throws_what_torch_raises(tmp_path, monkeypatch) -> None:
    import torch

    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        unavailable("no C++ compiler")
    monkeypatch.setenv(cpp_hooks.CACHE_ENV, str(tmp_path / "cache"))
    hooks = cpp_hooks.build("cuda")
    assert hooks.name.startswith("torch_cuda_hooks-") and hooks.parent == tmp_path / "cache"
    torch_dir = Path(torch.__file__).parent
    driver = tmp_path / "driver"
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))  # as torch's own libraries
    subprocess.run([cxx, "-std=c++17", "-O1", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}",
                    f"-I{HERE.parent / 'npu_pool' / 'csrc'}", str(HERE / "c" / "malloc_hook_driver.cpp"),
                    "-o", str(driver), f"-L{torch_dir / 'lib'}", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}", "-ldl"],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(driver), str(hooks)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["served"] == "returned block"
    assert lines["zero"] == "returned null"  # a zero-byte request is served by NULL, as torch's allocators do
    assert lines["oom"].startswith("OutOfMemoryError npu_pool: out of memory on device 0")
    assert lines["closed"].startswith("Error npu_pool: closed pool")
    assert cpp_hooks.build("cuda") == hooks  # cached and verified: not rebuilt
    with pytest.raises(ValueError, match="no C\\+\\+ hooks for 'rocm'"):
        cpp_hooks.build("rocm")


def test_cuda_hooks_load_binds_malloc_free_and_the_fraction(tmp_path, monkeypatch) -> None:
    """The CUDA hooks give torch's allocator a malloc, a free and the memory-fraction hook (which
    raises a fraction the pool refuses: tests/test_torch_npu.py runs the same code under torch_npu)."""
    if not (shutil.which("g++") or shutil.which("c++")):
        unavailable("no C++ compiler")
    monkeypatch.setenv(cpp_hooks.CACHE_ENV, str(tmp_path / "cache"))
    cpp_hooks.load.cache_clear()
    try:
        hooks = cpp_hooks.load("cuda")
    finally:
        cpp_hooks.load.cache_clear()
    assert [name for name, address in hooks.setters() if address] == ["set_memory_fraction_fn"]
    assert (hooks.MALLOC, hooks.FREE) == ("npu_pool_hooks_malloc", "npu_pool_hooks_free")
    assert Path(hooks.path).parent == tmp_path / "cache"
