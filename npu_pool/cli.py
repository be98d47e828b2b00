"""The ``npu-pool`` command: one entry point, one module per sub-command.

Each sub-command lives in ``npu_pool/commands/<name>.py`` and defines
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when
their command runs, so ``npu-pool --help`` stays fast and a missing optional
dependency of one command never breaks another.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any, NoReturn

# name -> one-line help. The module is npu_pool.commands.<name with - replaced by _>.
COMMANDS: dict[str, str] = {
    "demo": ("a Llama-7B training step (fake tensors) on a simulated 64 GiB device through every policy, then "
             "small models trained on this CPU (and ../shared/traces) replayed the same way"),
    "import": "convert PyTorch memory snapshots (.pickle) into npu_pool traces",
    "capture": "run real training steps of a small model on CPU and record its allocation trace",
    "replay": "replay traces through allocator policies on the simulated device",
    "merge": "merge the per-rank memory reports of a training run (NPU_POOL_REPORT_DIR) into one table",
    "analyze": "where the memory goes: peak, breakdown by category, sites, layers, fragmentation (md/json/html)",
    "export": "export a trace (replayed under a policy) as a PyTorch memory snapshot for memory_viz",
    "estimate": "static memory estimate per rank from a model config, optionally against a trace",
    "plan": "plan a trace's steady iteration: every allocation at a fixed offset (for --policy planned)",
}


def _module(name: str):
    return importlib.import_module(f"npu_pool.commands.{name.replace('-', '_')}")


def _not_an_input(path: Path) -> None:
    from . import inputs

    if inputs.was_read(path):
        raise FileExistsError(f"{path}: is also an input of this command; not overwritten (name another output)")


_EMPTY = "an empty value (an unset variable?)"


class _EmptyValue(Exception):
    """An option or argument given "" (``--out "$UNSET"``): refused by its type, said in one line."""


def _refusing_empty(type_: Any) -> Any:
    """``type_`` (None: the string itself), refusing "": a type such as Path turns it into "."."""
    def convert(text: str) -> Any:
        if text == "":
            raise argparse.ArgumentTypeError(_EMPTY)
        return type_(text) if type_ is not None else text
    convert.__name__ = getattr(type_, "__name__", "str")  # (argparse names a type in its messages)
    return convert


def _refusing(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``add_argument``'s keywords, a value-taking argument's type refusing "" (not where "" is
    the default: argparse converts a string default too)."""
    if kwargs.get("action", "store") in ("store", "append", "extend") and kwargs.get("nargs") != 0 \
            and kwargs.get("default") != "":
        kwargs["type"] = _refusing_empty(kwargs.get("type"))
    return kwargs


def _refusing_group(group: Any) -> Any:
    add = group.add_argument
    group.add_argument = lambda *args, **kwargs: add(*args, **_refusing(kwargs))
    return group


class _Parser(argparse.ArgumentParser):
    """argparse's parser, every value-taking argument refusing "" (abbreviated options too: argparse
    resolves them before it converts; those of argument groups too)."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        return super().add_argument(*args, **_refusing(kwargs))

    def add_argument_group(self, *args: Any, **kwargs: Any) -> Any:
        return _refusing_group(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, *args: Any, **kwargs: Any) -> Any:
        return _refusing_group(super().add_mutually_exclusive_group(*args, **kwargs))

    def error(self, message: str) -> NoReturn:
        if message.endswith(_EMPTY):
            raise _EmptyValue(message)
        super().error(message)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _Parser(prog="npu-pool", description="fragmentation-aware device memory pool tools")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"npu-pool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Build only the requested sub-parser fully; others get their help line.
    wanted = next((a for a in argv if not a.startswith("-")), None)
    try:
        for name, help_ in COMMANDS.items():
            p = sub.add_parser(name, help=help_, description=help_)
            if name == wanted:
                _module(name).add_arguments(p)  # (capture's imports torch: a second or two)
        args = parser.parse_args(argv)
    except _EmptyValue as e:  # ("" is no file, no number, no name: an unset variable, not the default)
        print(f"npu-pool {wanted}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("npu-pool: interrupted", file=sys.stderr)
        return 130
    if not args.command:
        parser.print_help()
        return 2
    if sys.stdout is None:  # started with stdout closed (`>&-`): print() would drop every line silently
        print(f"npu-pool {args.command}: error: standard output is closed, so nothing could be printed "
              "(redirect it instead, e.g. > /dev/null)", file=sys.stderr)
        return 1
    from . import inputs, outputs
    from .commands import UsageError
    from .pool import PoolError
    from .units import printable

    inputs.remember()  # a command never replaces one of its own inputs with an output
    outputs.guard(_not_an_input)
    streams = [(s, s.errors) for s in (sys.stdout, sys.stderr) if hasattr(s, "reconfigure")]
    try:
        for stream, _ in streams:  # a string from a file (a lone surrogate) prints as an escape
            stream.reconfigure(errors="backslashreplace")
        return int(_module(args.command).run(args) or 0)
    except KeyboardInterrupt:
        print("npu-pool: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:  # (the command line, as argparse's own refusals: 2)
        print(f"npu-pool {args.command}: error: {printable(str(e))}", file=sys.stderr)
        return 2
    except (OSError, ValueError, PoolError, MemoryError, RecursionError) as e:  # bad files, settings, devices
        # its frames, and those of the exception it replaced, hold what the command read (all of memory,
        # after a MemoryError): freed before the message is printed (only its text is)
        e.__traceback__ = e.__context__ = e.__cause__ = None
        text = str(e)
        if isinstance(e, OSError) and e.strerror and e.filename is None and e.errno is not None:
            text = e.strerror  # a message of the package's own, without Python's "[Errno N]"
        # one line, the message whole: a newline in it (a file's name, a YAML error's position)
        # prints as an escape; its first line alone said "/tmp/no" for a file named "/tmp/no\nsuch.npt"
        text = text.strip() or type(e).__name__
        print(f"npu-pool {args.command}: error: {printable(text)}", file=sys.stderr)  # (it may quote a file)
        return 1
    finally:
        inputs.forget()
        for stream, errors in streams:  # as the caller had them (npu-pool run in-process, by a test or a tool)
            try:
                stream.reconfigure(errors=errors)
            except (ValueError, OSError):  # closed meanwhile
                pass


if __name__ == "__main__":
    sys.exit(main())
