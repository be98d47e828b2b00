"""The layout rules of docs/engine.md, checked on the source: no import circle, the binding at
the bottom, one vocabulary shared by Python and C, one file per policy plus one registry line."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from npu_pool import vocab
from npu_pool._core import ffi, lib

PKG = Path(__file__).resolve().parents[1] / "npu_pool"
CSRC = PKG / "csrc"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere (functions included)."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            b = base
            for _ in range(max(node.level - 1, 0)):
                b = b.rpartition(".")[0]
            mod = (b + ("." + node.module if node.module else "")) if node.level else (node.module or "")
            # a name that is a module of the package is that module, any other name is mod's
            targets = [mod + "." + a.name if mod + "." + a.name in mods else mod for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            while t and t not in mods and "." in t:
                t = t.rpartition(".")[0]
            if t in mods and t != name and t != "npu_pool":
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of the graph, or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str]:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = 2
        stack.pop()
        return []

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def test_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    graph = _graph()
    assert len(graph) > 40  # the walk saw the package
    assert _cycle(graph) == []


# Names every module has without binding them.
_IMPLICIT = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__", "__path__",
             "__annotations__", "__dict__", "__class__", "__module__", "__qualname__"}


def _unbound(source: str, filename: str) -> list[tuple[str, str]]:
    """(scope, name) of each global name ``source`` reads that nothing binds: no import, def,
    class or assignment of the module, no ``global`` assignment, no builtin (a NameError when
    that line runs: analyze --format html raised one on every repaired snapshot until 2026-11-27,
    and no test had run that line)."""
    import builtins
    import symtable

    top = symtable.symtable(source, filename, "exec")
    tables, todo = [], [top]
    while todo:
        t = todo.pop()
        tables.append(t)
        todo.extend(t.get_children())
    bound = {s.get_name() for t in tables for s in t.get_symbols()
             if (t is top or s.is_declared_global()) and (s.is_assigned() or s.is_imported())}
    known = bound | set(dir(builtins)) | _IMPLICIT
    return sorted({(t.get_name(), s.get_name()) for t in tables for s in t.get_symbols()
                   if s.is_referenced() and s.get_name() not in known and (t is top or s.is_global())})


def test_the_unbound_name_finder_finds_one():
    src = "import os\nX = 1\ndef f(a):\n    global Y\n    Y = a\n    return os, X, Y, len, missing\n"
    assert _unbound(src, "m.py") == [("f", "missing")]
    assert _unbound("class C:\n    z = [w for w in range(3)]\n    def g(self):\n        return C, gone\n",
                    "m.py") == [("g", "gone")]


def test_no_module_reads_a_name_nothing_binds():
    root = PKG.parent
    files = [*PKG.rglob("*.py"), *(root / "mindspeed_patch").rglob("*.py"), root / "npu_pool_startup.py",
             *(root / "benchmarks").rglob("*.py"), *(root / "tests").rglob("*.py")]
    assert len(files) > 100
    assert {str(f.relative_to(root)): u for f in files if (u := _unbound(f.read_text(), str(f)))} == {}


def test_the_binding_is_the_bottom_layer():
    graph = _graph()
    # pool.py: the binding, the vocabulary, the fork-safe lock and the OOM snapshot writer, which
    # import nothing above them
    assert graph["npu_pool.pool"] <= {"npu_pool.vocab", "npu_pool.oom", "npu_pool.locks"}
    assert graph["npu_pool.vocab"] == set()
    assert graph["npu_pool.locks"] == set()
    assert graph["npu_pool.oom"] <= {"npu_pool.snapshot", "npu_pool.vocab", "npu_pool.units", "npu_pool.outputs",
                                     "npu_pool.locks"}
    assert graph["npu_pool.units"] == set()
    assert graph["npu_pool.outputs"] == set()  # whole-or-absent files: every writer uses it
    assert graph["npu_pool.inputs"] == set()  # regular files only, opened without blocking: every reader uses it
    assert graph["npu_pool.snapshot"] <= {"npu_pool.vocab", "npu_pool.outputs"}
    # the trace format and the recorder need nothing of the tools; the product needs no demo code
    for name, deps in graph.items():
        if name.startswith(("npu_pool.trace", "npu_pool.recorder")):
            assert not {d for d in deps if d.startswith(("npu_pool.analysis", "npu_pool.planner", "npu_pool.capture",
                                                         "npu_pool.commands"))}, name
        # demo workloads are for capture and the demo (and the published shapes of the static estimate)
        if not name.startswith(("npu_pool.capture", "npu_pool.commands", "npu_pool.workloads",
                                "npu_pool.analysis.estimate")):
            assert not {d for d in deps if d.startswith("npu_pool.workloads")}, name


def _layer_table() -> list[set[str]]:
    """docs/engine.md's table of the package, bottom first: per row, the modules and packages its
    first cell names (`x.py`, `x/`, `x/y.py`) as dotted names."""
    doc = (PKG.parent / "docs" / "engine.md").read_text()
    section = doc[doc.index("## The Python package"):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names = set()
            for n in re.findall(r"`([^`]+)`", line.split("|")[1]):
                if n.endswith("/") or n.endswith(".py"):
                    names.add("npu_pool." + n.rstrip("/").removesuffix(".py").removesuffix("/__init__").replace("/", "."))
                elif re.fullmatch(r"\w+", n):
                    names.add("npu_pool." + n)
            rows.append(names)
    return rows


def test_each_module_imports_only_modules_below_it_in_the_docs_table():
    """docs/engine.md lists the package from the bottom of the import graph up: every module is in
    a row (its own, else its package's), and imports only modules of its row or rows below."""
    rows = _layer_table()
    where = {name: i for i, names in enumerate(rows) for name in names}

    def row(module: str) -> int | None:
        while module not in where and "." in module:
            module = module.rpartition(".")[0]
        return where.get(module)

    graph = _graph()
    assert not [m for m in graph if m != "npu_pool" and row(m) is None]  # every module is in the table
    wrong = [f"{m} -> {d}" for m, deps in graph.items() if m != "npu_pool" for d in deps if row(d) > row(m)]
    assert not wrong


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a Name or an attribute chain of Names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _private_reads(name: str, path: Path, mods: dict[str, Path]) -> list[str]:
    """``module._name`` reads in ``name`` of another module of the package, however it was
    imported (``from . import oom``, ``from npu_pool import oom``, ``import npu_pool.install as
    inst``, ``import npu_pool.oom`` then ``npu_pool.oom._x``)."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}  # local name -> the package module (or package) it is
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            b = base
            for _ in range(max(node.level - 1, 0)):
                b = b.rpartition(".")[0]
            mod = (b + ("." + node.module if node.module else "")) if node.level else (node.module or "")
            for a in node.names:
                if f"{mod}.{a.name}" in mods:
                    aliases[a.asname or a.name] = f"{mod}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods and a.asname:
                    aliases[a.asname] = a.name
                elif a.name in mods:  # (import npu_pool.oom binds npu_pool)
                    top = a.name.partition(".")[0]
                    aliases[top] = top
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = _dotted(node.value)
            if owner is None:
                continue
            first, _, rest = owner.partition(".")
            module = aliases.get(first, "") + ("." + rest if rest else "") if first in aliases else None
            if module in mods and module != name:
                out.append(f"{name}: {owner}.{node.attr}")
    return out


def test_no_module_reads_another_modules_private_state():
    """``module._name`` of another package module is read nowhere (private helpers imported by
    name, like the binding's ``_check``, are the one allowed form)."""
    mods = _modules()
    assert [r for name, path in mods.items() for r in _private_reads(name, path, mods)] == []


def test_the_private_state_check_sees_every_form_of_import(tmp_path):
    """(It once followed relative imports only.)"""
    mods = _modules()
    for text in ("from .. import oom\nx = oom._written", "from npu_pool import oom\nx = oom._written",
                 "import npu_pool.install as inst\nx = inst._current", "import npu_pool.oom\nx = npu_pool.oom._written",
                 "from npu_pool.trace import snapshot as s\nx = s._put"):
        f = tmp_path / "probe.py"
        f.write_text(text)
        assert len(_private_reads("npu_pool.commands.probe", f, mods)) == 1, text
    f.write_text("from .. import oom\nx = oom.ENV\ny = oom.__name__")
    assert _private_reads("npu_pool.commands.probe", f, mods) == []


def _c_enum(prefix: str) -> dict[str, int]:
    """``NP_<prefix>_*`` constants of npu_pool.h as the compiler sees them (through the binding)."""
    header = (CSRC / "npu_pool.h").read_text()
    names = set(re.findall(rf"\b(NP_{prefix}_[A-Z_0-9]+)\s*=", header))
    return {n: getattr(lib, n) for n in names}


def test_python_and_c_share_one_vocabulary():
    tables = [("MARK", vocab.MARK_NAMES), ("OP", vocab.OP_NAMES), ("CAT", vocab.CAT_NAMES),
              ("HINTS", vocab.HINTS), ("EV", vocab.EVENT_NAMES), ("STAGE", vocab.STAGE_NAMES),
              ("LIFE", vocab.LIFETIMES), ("BACKEND", vocab.BACKENDS)]
    for prefix, names in tables:
        codes = _c_enum(prefix)
        assert codes[f"NP_{prefix}_COUNT"] == len(names), prefix
        for const, code in codes.items():
            if not const.endswith("_COUNT"):
                assert 0 <= code < len(names), const
    # names of the enum constants and of the vocabulary agree (NP_MARK_LAYER_ENTER <-> "layer_enter")
    for const, code in _c_enum("MARK").items():
        if not const.endswith("_COUNT"):
            assert vocab.MARK_NAMES[code] == const.removeprefix("NP_MARK_").lower()
    for const, code in _c_enum("OP").items():
        if not const.endswith("_COUNT"):
            assert vocab.OP_NAMES[code] == const.removeprefix("NP_OP_").lower()
    assert vocab.ROUND == lib.NP_ROUND == 512 and vocab.SIM_PAGE == lib.NP_SIM_PAGE
    from npu_pool.planner.plan import ALIGN
    from npu_pool.replay import CAPACITY_STEP
    from npu_pool.trace import format as fmt

    assert ALIGN == vocab.ROUND and CAPACITY_STEP == vocab.SIM_PAGE
    assert (fmt.MARK_NAMES, fmt.OP_NAMES, fmt.CAT_NAMES) == (vocab.MARK_NAMES, vocab.OP_NAMES, vocab.CAT_NAMES)
    assert ffi.sizeof("np_event_info") > 0


def test_the_stage_table_is_the_cores():
    """Every ``<stage>_begin`` marker opens that stage and its ``_end`` closes it; the Python
    tables (recorder, phases) are the core's."""
    from npu_pool.analysis import phases
    from npu_pool.recorder import _marks

    for code, name in enumerate(vocab.MARK_NAMES):
        what, _, edge = name.rpartition("_")
        if what in vocab.STAGE_NAMES and edge == "begin":
            assert vocab.STAGE_OPENED[code] == what
        elif what in vocab.STAGE_NAMES and edge == "end":
            assert vocab.STAGE_CLOSED[code] == what and code not in vocab.STAGE_OPENED
        else:  # iteration and layer markers open and close no stage
            assert code not in vocab.STAGE_OPENED and code not in vocab.STAGE_CLOSED
    assert lib.np_mark_opens(vocab.MARK_LAYER_ENTER) == -1 and lib.np_mark_opens(vocab.MARK_ITER_BEGIN) == 0
    assert lib.np_mark_opens(-1) == lib.np_mark_opens(len(vocab.MARK_NAMES)) == -1
    assert _marks.STAGE_OF == vocab.STAGE_OPENED
    assert phases.PhaseTracker is not None and set(_marks.END_OF) == set(vocab.STAGE_CLOSED)


def test_a_policy_is_one_file_plus_one_registry_line():
    registry = re.findall(r"^\s+X\((\w+)\)", (CSRC / "policies.c").read_text(), re.M)
    files = sorted(p.stem.removeprefix("policy_") for p in CSRC.glob("policy_*.c"))
    assert sorted(registry) == files and tuple(registry) == vocab.POLICIES
    for src in CSRC.glob("*.[ch]"):
        named = set(re.findall(r"np_policy_(" + "|".join(files) + r")\b", src.read_text()))
        assert not named or src.name == f"policy_{named.pop()}.c" and not named, src.name
    for name in vocab.POLICIES:  # the policy says what its pools are
        assert all(vocab.POOL_NAMES[name]) and all(vocab.POOL_MEANINGS[name]) and vocab.POLICY_SUMMARIES[name]


def test_history_bounds_are_the_cores():
    from npu_pool import Pool, torch_memory  # noqa: F401  (imports nothing of torch)
    from npu_pool.pool import InvalidArgumentError

    assert vocab.HISTORY_MAX == (1 << 40) // ffi.sizeof("np_event_info") and vocab.HISTORY_DEFAULT == 4096
    with Pool("npu_pool") as p:
        p.set_history(vocab.HISTORY_MAX)  # the bound itself is taken
        for bad in (lambda: p.set_history(vocab.HISTORY_MAX + 1), lambda: p.history(vocab.HISTORY_MAX + 1)):
            try:
                bad()
            except InvalidArgumentError:
                continue
            raise AssertionError("a history past the core's bound was taken")
    assert lib.npu_pool_set_history(-1, vocab.HISTORY_MAX + 1) != 0


def test_every_name_docs_api_gives_the_package_is_there():
    """docs/api.md names these as ``npu_pool.<name>``: each one is an attribute of the package
    (DoubleFreeError, UnknownPointerError, BackendError, current_pool and set_backup_limit were
    not), and the package exports nothing the docs leave out."""
    import npu_pool

    documented = {"Pool", "PoolError", "OutOfMemoryError", "InvalidArgumentError", "DoubleFreeError",
                  "UnknownPointerError", "BackendError", "POLICIES", "install", "installed", "current_pool",
                  "set_fraction", "set_compaction", "compact", "region", "pause", "resume", "set_backup_limit", "tags"}
    text = (PKG.parent / "docs" / "api.md").read_text()
    for name in documented:
        assert getattr(npu_pool, name) is not None and re.search(rf"`(npu_pool\.)?{name}\b", text), name
    assert set(npu_pool.__all__) == documented | {"__version__"}


def test_docs_cli_names_every_option_of_every_command(capsys):
    """docs/cli.md lists each command's options (replay --hints, demo's and export's --device
    were documented nowhere): the long options of `npu-pool COMMAND --help` and those of the
    page's section for it are the same set."""
    import pytest

    from npu_pool.cli import COMMANDS, main

    text = (PKG.parent / "docs" / "cli.md").read_text()
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    assert set(sections) == set(COMMANDS)
    option = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
    for command, section in sections.items():
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helped = set(option.findall(capsys.readouterr().out)) - {"--help"}
        assert helped and set(option.findall(section)) == helped, (command, helped ^ set(option.findall(section)))
