"""Build a fake CANN runtime that the real torch_npu loads on a CPU-only machine.

``build(out_dir)`` compiles ``fake_cann.c`` (memory, streams, events, copies) plus a loud
stub for every other symbol of ``cann_symbols.txt`` into ``libascendcl.so``, and the
companion libraries torch_npu links (``libhccl.so``, ``libacl_op_compiler.so``,
``libge_runner.so``, ``libgraph.so``, ``libacl_tdt_channel.so``), each linked against the
fake ``libascendcl.so`` so that a ``dlsym`` through its handle finds the runtime's symbols.
Put ``out_dir`` on ``LD_LIBRARY_PATH`` of the process that imports torch_npu.

``cann_symbols.txt`` is pinned to one torch-npu version and checked in; regenerate it from
an installed torch_npu with ``python tests/fake_vendor/cann.py --update`` (run by the
interpreter of the venv that has torch_npu): every CANN symbol its libraries import (all
must exist at load: they are linked with BIND_NOW) and the ones it looks up with ``dlsym``
and insists on, each with its C return type from the ACL headers torch_npu ships.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYMBOLS = HERE / "cann_symbols.txt"
COMPANIONS = ("hccl", "acl_op_compiler", "ge_runner", "graph", "acl_tdt_channel")
# What a stub returns, by the C return type: an error code, NULL, nothing, or 0.
KINDS = ("error", "pointer", "void", "zero")
# Looked up with dlsym at run time; torch_npu stops with "Failed to find function X" without them.
DLSYM_REQUIRED = ("aclrtSetDeviceSatMode", "aclSetCompileopt", "aclrtSetOpExecuteTimeOut", "aclrtDestroyStreamForce",
                  "aclrtQueryEventStatus", "aclrtGetSysParamOpt", "aclrtSetSysParamOpt", "aclrtCtxSetSysParamOpt",
                  "aclrtCreateEventWithFlag", "aclrtStreamQuery", "aclrtSynchronizeDevice", "aclrtMemsetAsync",
                  "aclrtQueryEventWaitStatus", "aclrtStreamGetId", "aclopCompileAndExecuteV2",
                  "aclrtMallocAlign32", "aclrtSynchronizeStreamWithTimeout", "aclrtGetMemUsageInfo")
_PREFIX = re.compile(r"^(acl|rt[A-Z]|Msprof|Hccl|hccl|ge[A-Z])\w*$")


class BuildError(RuntimeError):
    """The fake runtime could not be built (no compiler, a bad symbol list)."""


def read_symbols(path: Path = SYMBOLS) -> list[tuple[str, str]]:
    """``[(symbol, kind)]`` of the checked-in list (``#`` starts a comment)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2 or parts[1] not in KINDS or not re.fullmatch(r"[A-Za-z_]\w*", parts[0]):
            raise BuildError(f"{path}:{n}: expected 'SYMBOL KIND [ORIGIN]' with KIND one of {KINDS}, got {line!r}")
        out.append((parts[0], parts[1]))
    return out


def _stub(name: str, kind: str) -> str:
    ret = {"error": "NOT_SUPPORTED", "pointer": "0", "void": "0", "zero": "0"}[kind]
    return (f'__attribute__((visibility("default"))) long {name}(void) {{\n'
            f'  fake_cann_stub("{name}");\n  return {ret};\n}}\n')


def _defined(cc: str, source: Path, work: Path) -> set[str]:
    """Symbols the hand-written runtime defines (its object file's exported names)."""
    obj = work / "fake_cann.o"
    _run([cc, "-c", "-fPIC", "-O1", "-o", str(obj), str(source)])
    nm = shutil.which("nm")
    if nm is None:
        raise BuildError("nm (binutils) is needed to build the fake CANN runtime")
    out = subprocess.run([nm, "--defined-only", "-g", str(obj)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise BuildError(f"{' '.join(cmd)} failed:\n{r.stderr}")


# Settings of the calling process a child started over the fake must not inherit: they would switch
# npu_pool on, configure it, ask for snapshots, or load another runtime.
CLEAN = ("MEMORY_FRAGMENTATION", "NPU_POOL_", "OOM_SNAPSHOT_", "LD_LIBRARY_PATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")


def env(lib_dir: Path, root: Path, cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a process that imports torch_npu over the fake built in ``lib_dir``,
    with npu_pool from the checkout ``root`` and its hooks cached in ``cache``; ``extra`` on top."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)}
    out.update(LD_LIBRARY_PATH=str(lib_dir), NPU_POOL_CACHE=str(cache), PYTHONPATH=str(root), PYTHONUNBUFFERED="1")
    out.update(extra)
    return out


def build(out_dir: Path) -> Path:
    """Build the fake runtime into ``out_dir``; returns it (for ``LD_LIBRARY_PATH``)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise BuildError("no C compiler (cc/gcc) to build the fake CANN runtime")
    out_dir.mkdir(parents=True, exist_ok=True)
    defined = _defined(cc, HERE / "fake_cann.c", out_dir)
    stubs = out_dir / "cann_stubs.c"
    stubs.write_text("/* generated by tests/fake_vendor/cann.py from cann_symbols.txt: do not edit */\n"
                     "#define NOT_SUPPORTED 207000\nint fake_cann_stub(const char *fn);\n"
                     + "".join(_stub(s, k) for s, k in read_symbols() if s not in defined))
    acl = out_dir / "libascendcl.so"
    _run([cc, "-shared", "-fPIC", "-O1", "-fno-builtin", "-o", str(acl), str(out_dir / "fake_cann.o"), str(stubs),
          "-lpthread"])
    for name in COMPANIONS:
        _run([cc, "-shared", "-fPIC", "-o", str(out_dir / f"lib{name}.so"), "-x", "c", "/dev/null", f"-L{out_dir}",
              "-Wl,--no-as-needed", "-lascendcl", f"-Wl,-rpath,{out_dir}"])
    return out_dir


# ---- regenerating the list from an installed torch_npu -------------------------------------------

def _return_kinds(include: Path) -> dict[str, str]:
    decl = re.compile(r"^\s*(?:ACL_FUNC_VISIBILITY|MSVP_PROF_API|RTS_API|HCCL_API|extern)?\s*"
                      r"((?:const\s+)?[A-Za-z_][\w]*(?:\s*\*+)?)\s*\**\s*(\w+)\s*\(", re.M)
    kinds: dict[str, str] = {}
    for h in include.rglob("*.h"):
        for m in decl.finditer(h.read_text(errors="replace")):
            ret, name = m.group(1), m.group(2)
            full = m.group(0)
            if "*" in full.split(name)[0]:
                kinds.setdefault(name, "pointer")
            elif ret.strip() == "void":
                kinds.setdefault(name, "void")
            elif ret.strip() in ("aclError", "int", "int32_t", "rtError_t", "HcclResult", "aclnnStatus"):
                kinds.setdefault(name, "error")
            else:
                kinds.setdefault(name, "zero")  # sizes, counts, enums, timestamps
    return kinds


def update() -> None:
    """Rewrite cann_symbols.txt from the torch_npu importable by this interpreter."""
    import importlib.util
    import importlib.metadata

    spec = importlib.util.find_spec("torch_npu")
    if spec is None or spec.origin is None:
        raise SystemExit("torch_npu is not installed for this interpreter")
    root = Path(spec.origin).parent
    nm = shutil.which("nm") or "nm"
    imported: set[str] = set()
    for so in [*root.glob("_C*.so"), *(root / "lib").glob("*.so")]:
        out = subprocess.run([nm, "-D", "--undefined-only", str(so)], capture_output=True, text=True).stdout
        imported |= {ln.split()[-1].split("@")[0] for ln in out.splitlines() if ln.strip()}
    imported = {s for s in imported if _PREFIX.match(s)}
    kinds = _return_kinds(root / "include")
    lines = [f"# CANN symbols the real torch-npu {importlib.metadata.version('torch-npu')} needs from the runtime;",
             "# generated by `python tests/fake_vendor/cann.py --update` -- do not edit by hand.",
             "# SYMBOL  KIND (what its stub returns: error | pointer | void | zero)  ORIGIN (import | dlsym)"]
    for s in sorted(imported | set(DLSYM_REQUIRED)):
        lines.append(f"{s} {kinds.get(s, 'error')} {'import' if s in imported else 'dlsym'}")
    SYMBOLS.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines) - 3} symbols to {SYMBOLS}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        update()
    elif len(sys.argv) == 2:
        print(build(Path(sys.argv[1])))
    else:
        raise SystemExit("usage: cann.py --update | cann.py OUT_DIR")
