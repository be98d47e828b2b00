"""``export MEMORY_FRAGMENTATION=1`` is all it takes: the start-up hook (npu_pool_startup.pth,
which setup.py installs into site-packages) switches the pool on in a script that never names
npu_pool, and stays out of the way without the variable.

How the hook gets into the Pythons these tests start: each test makes a throwaway venv (no
pip, a third of a second) over the base interpreter of the Python under test, puts into its
site-packages the .pth exactly as setup.py writes it (``npu_pool_startup.PTH_LINE``) and a .pth
that adds the tested Python's own site-packages (torch, torch_npu) with ``site.addsitedir`` (as
`./run` does for .venv-torch-npu). So the .pth is processed by site.py at start-up, in every
process, torchrun's workers included, as after ``pip install``; only the hook module itself is
found through ``PYTHONPATH`` (this tree) instead of site-packages. That setup.py installs the
.pth for regular and editable installs is checked by building both wheels (slow)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, SHARED, TorchNpu, unavailable

sys.path.insert(0, str(ROOT))
import npu_pool_startup  # noqa: E402

# A training script's beginning that never names npu_pool (nor mindspeed_patch).
SCRIPT = """
import json, sys
import torch
dev = "npu" if hasattr(torch, "npu") and torch.npu.is_available() else "cpu"
host = torch.arange(3 << 20).remainder(251).to(torch.uint8)
x = host.to(dev)                                           # 3 MiB on the device
print(json.dumps({"device": dev, "roundtrip": bool(torch.equal(x.cpu(), host)), "modules": sorted(m for m in sys.modules
      if m.split(".")[0] in ("npu_pool", "npu_pool_startup", "mindspeed_patch"))}))
"""
# After the script: who served the tensor (this part may name npu_pool; it runs last).
CHECK = """
import torch
before = sorted(m for m in sys.modules if m.split(".")[0] in ("npu_pool", "mindspeed_patch"))
out = {"before_check": before}
if "npu_pool.install" in sys.modules:
    from npu_pool.install import installed, _current
    pools = installed()
    out["pool_allocated"] = pools[0].stats()["total"]["allocated"]["current"] if pools else None
    out["hooks"] = sorted(_current.hooks) if _current else []
out["torch_allocated"] = torch.npu.memory_allocated() if hasattr(torch, "npu") else None
print(json.dumps(out))
"""


def hooked_python(base: str, tmp: Path) -> Path:
    """A venv whose site-packages holds the start-up hook's .pth, over ``base``'s packages."""
    probe = subprocess.run([base, "-c", "import sys, sysconfig; print(sys._base_executable); "
                            "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True)
    real, purelib = probe.stdout.split("\n")[:2]
    venv = tmp / "venv"
    subprocess.run([real, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / npu_pool_startup.PTH).write_text(npu_pool_startup.PTH_LINE)
    (site / "_tested_python.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
    return python


def _run(python: Path, code: str, env: dict[str, str], timeout: int = 300) -> list[dict]:
    r = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                       cwd=str(ROOT))
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]


def test_the_variable_alone_puts_a_script_on_the_pool_under_real_torch_npu(torch_npu: TorchNpu,
                                                                          tmp_path: Path) -> None:
    python = hooked_python(torch_npu.python, tmp_path)
    conf = "expandable_segments:True,max_split_size_mb:128"
    r = subprocess.run([str(python), "-c", SCRIPT + CHECK], capture_output=True, text=True, timeout=300,
                       env=torch_npu.env(MEMORY_FRAGMENTATION="1", PYTORCH_NPU_ALLOC_CONF=conf), cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-4000:]
    script, check = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert script["device"] == "npu" and script["roundtrip"]
    # torch_npu's allocator settings: one line at install naming each and what npu_pool does instead
    (line,) = [ln for ln in r.stderr.splitlines() if "device allocator settings do not apply" in ln]
    assert "PYTORCH_NPU_ALLOC_CONF: expandable_segments:True (" in line and "max_split_size_mb:128 (" in line
    assert "npu_pool_startup" in script["modules"] and "npu_pool.install" in script["modules"]
    # x, served by the pool (torch_npu pads each request by 32 bytes, rounded to 512), as torch reports
    assert check["pool_allocated"] == (3 << 20) + 512 == check["torch_allocated"]
    assert "set_init_fn" in check["hooks"]


def test_without_the_variable_torch_npus_own_allocator_serves_and_npu_pool_is_not_imported(
        torch_npu: TorchNpu, tmp_path: Path) -> None:
    python = hooked_python(torch_npu.python, tmp_path)
    for value in (None, "0"):
        env = torch_npu.env(**({"MEMORY_FRAGMENTATION": value} if value is not None else {}))
        script, check = _run(python, SCRIPT + CHECK, env)
        assert script["device"] == "npu" and script["roundtrip"] and script["modules"] == [] and check["before_check"] == []
        assert check["torch_allocated"] >= 3 << 20 and "pool_allocated" not in check


def test_a_bad_value_stops_at_import_torch_with_one_line(torch_npu: TorchNpu, tmp_path: Path) -> None:
    python = hooked_python(torch_npu.python, tmp_path)
    afile = tmp_path / "afile"
    afile.write_bytes(b"not a plan")
    from test_planner import training

    from npu_pool.planner import make_plan, save_plan

    cuda_plan = tmp_path / "cuda.npplan"
    save_plan(make_plan(training()), cuda_plan)
    for env, words in [({"MEMORY_FRAGMENTATION": "yes"}, "MEMORY_FRAGMENTATION='yes' is not valid"),
                       # a bad plan file (a PlanError from install: a 26-line traceback before)
                       ({"MEMORY_FRAGMENTATION": "1", "NPU_POOL_POLICY": "planned", "NPU_POOL_PLAN": str(afile)},
                        f"NPU_POOL_PLAN: {afile}: not an npu_pool plan"),
                       ({"MEMORY_FRAGMENTATION": "1", "NPU_POOL_PLAN": str(afile)},  # ignored before
                        "which only the planned policy serves, but the policy is npu_pool"),
                       ({"MEMORY_FRAGMENTATION": "1", "NPU_POOL_OOM_SNAPSHOT": str(afile)},  # said at the first OOM before
                        "NPU_POOL_OOM_SNAPSHOT="),
                       # a cache directory the user named that cannot be one: a warning before, the hooks then off
                       ({"MEMORY_FRAGMENTATION": "1", "NPU_POOL_CACHE": str(afile / "cache")},
                        "NPU_POOL_CACHE: cannot create the cache directory"),
                       # a plan made under CUDA's request rules (a capture's): every request would miss
                       ({"MEMORY_FRAGMENTATION": "1", "NPU_POOL_POLICY": "planned", "NPU_POOL_PLAN": str(cuda_plan)},
                        "made with cuda's request rules and this npu device applies npu's"),
                       ]:
        r = subprocess.run([str(python), "-c", "print('started'); import torch; print('not reached')"],
                           env=torch_npu.env(**env), capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stdout.startswith("started") and "not reached" not in r.stdout, r.stderr[-2000:]
        (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("npu_pool: ")]
        assert words in line and "Traceback" not in r.stderr, r.stderr[-2000:]
    # a process that never imports torch is not touched
    r = subprocess.run([str(python), "-c", "print('fine')"], env=torch_npu.env(MEMORY_FRAGMENTATION="yes"),
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "fine", "")


def test_the_hook_fires_in_every_process_torchrun_starts_but_not_in_its_launcher(tmp_path: Path) -> None:
    """CPU torch: the pool cannot install (no device), the Megatron patch still runs (recorder
    mode), in each worker; the launcher imports torch but is left alone."""
    python = hooked_python(sys.executable, tmp_path)
    script = tmp_path / "worker.py"
    script.write_text("import json, os, sys, torch\n"
                      "from pathlib import Path\n"
                      "ms = sys.modules.get('mindspeed_patch.megatron')\n"
                      "s = ms.session() if ms else None\n"
                      "Path(sys.argv[1], os.environ['RANK']).write_text(json.dumps("
                      "{'session': s is not None and s.mode}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMORY_FRAGMENTATION", "NPU_POOL_"))}
    env.update(MEMORY_FRAGMENTATION="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([str(python), "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
                        str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = {p.name: json.loads(p.read_text()) for p in tmp_path.iterdir() if p.name.isdigit()}
    assert ranks == {"0": {"session": "recorder"}, "1": {"session": "recorder"}}
    assert r.stderr.count("MEMORY_FRAGMENTATION=1, but npu_pool was not installed") == 2  # workers, not launcher


MEGATRON_LM = SHARED / "clients" / "megatron-lm" / "megatron" / "training" / "training.py"


def test_real_megatron_training_functions_are_wrapped_without_importing_mindspeed_patch(tmp_path: Path) -> None:
    if not MEGATRON_LM.is_file():
        unavailable("../shared/clients/megatron-lm is absent (fresh clone)")
    for m in ("einops", "regex", "six", "pydantic", "megatron.core"):
        try:
            __import__(m)
        except ImportError:
            unavailable(f"the real megatron.training needs {m} (`./run test` installs it)")
    python = hooked_python(sys.executable, tmp_path)
    code = ("import json, sys; sys.path.insert(0, 'tests'); import megatron_real as mr\n"
            "mr._paths(mindspeed=False)\n"
            "import megatron.training.training as t, megatron.core.pipeline_parallel.schedules as s\n"
            "print(json.dumps({'file': t.__file__, 'training': mr._wrapped(t, ('setup_model_and_optimizer', "
            "'train_step', 'evaluate')), 'schedules': mr._wrapped(s, ('forward_step', 'backward_step'))}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMORY_FRAGMENTATION", "NPU_POOL_"))}
    env.update(MEMORY_FRAGMENTATION="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NPU_POOL_SHARED=str(SHARED))
    (out,) = _run(python, code, env, timeout=240)
    assert out["file"].startswith(str(SHARED))
    assert out["training"] == {"setup_model_and_optimizer": True, "train_step": True, "evaluate": True}
    assert out["schedules"] == {"forward_step": True, "backward_step": True}


def test_import_mindspeed_patch_still_works_with_the_hook_armed(tmp_path: Path) -> None:
    python = hooked_python(sys.executable, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMORY_FRAGMENTATION", "NPU_POOL_"))}
    env.update(MEMORY_FRAGMENTATION="1", PYTHONPATH=str(ROOT))
    (out,) = _run(python, "import json, mindspeed_patch, torch; from mindspeed_patch.megatron import session; "
                          "print(json.dumps({'mode': session().mode}))", env)
    assert out == {"mode": "recorder"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_setup_py_installs_the_pth_for_regular_and_editable_installs(kind: str, tmp_path: Path) -> None:
    # built from a copy: an editable build rewrites npu_pool/_core*.so in place, which this process has loaded
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", ".venv*", "*.so", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", ".hypothesis", "out"))
    hook = "build_wheel" if kind == "wheel" else "build_editable"
    code = (f"import setuptools.build_meta as b; print(b.{hook}({str(tmp_path)!r}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=str(src), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = tmp_path / r.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as z:
        assert z.read(npu_pool_startup.PTH).decode() == npu_pool_startup.PTH_LINE
        names = z.namelist()
    if kind == "wheel":
        assert "npu_pool_startup.py" in names and "mindspeed_patch/__init__.py" in names


def test_the_pth_line_imports_nothing_while_the_switch_is_off() -> None:
    code = ("import os, sys; before = set(sys.modules); exec(sys.argv[1]); "  # site.py has imported os
            "print(sorted(set(sys.modules) - before))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMORY_FRAGMENTATION", "NPU_POOL_"))}
    for extra in ({}, {"MEMORY_FRAGMENTATION": "0"}, {"MEMORY_FRAGMENTATION": " "}):
        r = subprocess.run([sys.executable, "-S", "-c", code, npu_pool_startup.PTH_LINE], env={**env, **extra},
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout.strip()) == (0, "[]"), r.stderr
    assert sysconfig.get_paths()["purelib"]  # (the .pth's home)


def test_torch_allocator_settings_are_named_with_what_npu_pool_does_instead() -> None:
    from npu_pool.alloc_conf import INSTEAD, ignored_message

    assert ignored_message({}) is None and ignored_message({"PYTORCH_ALLOC_CONF": "  "}) is None
    msg = ignored_message({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6, weird",
                           "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert msg is not None and "\n" not in msg
    assert f"PYTORCH_ALLOC_CONF: garbage_collection_threshold:0.6 ({INSTEAD['garbage_collection_threshold']})" in msg
    assert "weird (not an npu_pool setting)" in msg and "PYTORCH_CUDA_ALLOC_CONF: backend:cudaMallocAsync" in msg
    hostile = ignored_message({"PYTORCH_NPU_ALLOC_CONF": ",".join(["x" * 10_000] * 10_000)})
    assert hostile is not None and len(hostile) < 5_000  # bounded, whatever the value


def test_host_memory_settings_and_the_allocators_switches_are_named_for_what_they_are() -> None:
    """torch_npu still reads its alloc conf for pinned host memory (a key it does not know fails the first
    pin_memory(), with npu_pool or not): those settings are named as torch's; a bracketed value keeps its
    commas; the caching allocator's switches of their own are named too (they were silently ignored)."""
    from npu_pool.alloc_conf import ignored_message

    assert "pinned_use_background_threads:True (still torch's" in (
        ignored_message({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_background_threads:True"}) or "")
    msg = ignored_message({"PYTORCH_NPU_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2], pinned_mem_register:True",
                           "PYTORCH_NO_NPU_MEMORY_CACHING": "1", "MULTI_STREAM_MEMORY_REUSE": "2"})
    assert msg is not None and "\n" not in msg and "pinned host memory" in msg
    assert "roundup_power2_divisions:[256:1,512:2] (npu_pool rounds" in msg and "512:2] (" not in msg.replace(
        "[256:1,512:2] (", "")
    assert "pinned_mem_register:True (still torch's: pinned host memory)" in msg
    assert "PYTORCH_NO_NPU_MEMORY_CACHING=1 (" in msg and "MULTI_STREAM_MEMORY_REUSE=2 (" in msg
    assert ignored_message({"PYTORCH_NO_CUDA_MEMORY_CACHING": " "}) is None


MINDSPEED = SHARED / "clients" / "mindspeed" / "mindspeed" / "patch_utils.py"


@pytest.mark.parametrize("order", ["mindspeed-first", "patch-first"])
def test_real_mindspeed_applies_its_patches_with_the_hook_armed(tmp_path: Path, order: str) -> None:
    """The hook patches Megatron at `import torch`, before MindSpeed applies its patches: its
    apply_patches() then imports megatron.training.training, and our wrapper registers with
    its manager while it iterates its patches. MindSpeed's replacement and wrapper run, and ours."""
    if not (MEGATRON_LM.is_file() and MINDSPEED.is_file()):
        unavailable("../shared/clients is absent (fresh clone)")
    python = hooked_python(sys.executable, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMORY_FRAGMENTATION", "NPU_POOL_"))}
    env.update(MEMORY_FRAGMENTATION="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NPU_POOL_SHARED=str(SHARED))
    r = subprocess.run([str(python), str(ROOT / "tests" / "megatron_real.py"), "mindspeed", order], env=env,
                       capture_output=True, text=True, timeout=240, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert out["calls"] == ["mindspeed wrapper", "replacement"] * 2
    assert out["marks"] == [["iter_begin", 4], ["iter_end", 4], ["iter_begin", 5], ["iter_end", 5]]
    assert out["iterations"] == 2 and "npu_pool_train_step_wrapper" in out["wrappers"]
