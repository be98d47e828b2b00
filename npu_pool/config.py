"""Settings of the installed allocator, from environment variables and an optional YAML file.

``MEMORY_FRAGMENTATION`` (0/1) turns the pool on: the start-up hook the package installs then
installs it as torch imports, in every process (``import mindspeed_patch`` does the same by hand);
``NPU_POOL_FRACTION`` (a number in (0, 1]) caps the memory it may reserve;
``NPU_POOL_POLICY`` (torch, npu_pool, expandable, planned) picks the placement policy;
``NPU_POOL_PLAN`` names the plan file the ``planned`` policy serves (``npu-pool plan``);
``NPU_POOL_COMPACT`` (0/1) turns compaction on (``Pool.set_compaction``: policies npu_pool and planned);
``NPU_POOL_CONFIG`` names a YAML file with the same keys in lower case. A variable set
in the environment overrides the file. Any bad value raises :class:`ConfigError`
naming the variable and the accepted values.

Every YAML file the package reads (this one, ``npu-pool estimate --config``) goes through
:func:`load_yaml`: at most :data:`YAML_MAX_BYTES`, UTF-8, no aliases (a "billion laughs"
file expands nothing), at most :data:`YAML_MAX_DEPTH` levels, integers of at most
:data:`YAML_MAX_DIGITS` digits; anything else is a ConfigError naming the file and the
problem. Numbers in the environment are read by :func:`parse_int` (ASCII digits only).

Pure Python: importing it needs neither torch nor the compiled core.
"""
from __future__ import annotations

import errno
import math
import os
import re
import stat
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .inputs import NotRegularFile, kind_of, open_regular

ENABLE = "MEMORY_FRAGMENTATION"
FRACTION = "NPU_POOL_FRACTION"
POLICY = "NPU_POOL_POLICY"
PLAN = "NPU_POOL_PLAN"
CONFIG_FILE = "NPU_POOL_CONFIG"
COMPACT = "NPU_POOL_COMPACT"
POLICY_NAMES: tuple[str, ...] = ("torch", "npu_pool", "expandable", "planned")  # the keys of npu_pool.pool.POLICIES
COMPACTING_POLICIES: tuple[str, ...] = ("npu_pool", "planned")  # those whose core policy compacts (policy.h: its compact hook)
_KEYS = (ENABLE, FRACTION, POLICY, PLAN, COMPACT)
# Every NPU_POOL_* variable something reads: these settings, the ones read where they apply
# (cpp_hooks.CACHE_ENV, oom.ENV, mindspeed_patch.megatron's LOG_EVERY and REPORT_DIR), and the
# repository's own tooling (./run, .ci/run, the tests and benchmarks/cuda_call_costs.py); any other
# is a typo to point out.
KNOWN_VARIABLES = (FRACTION, POLICY, PLAN, COMPACT, CONFIG_FILE, "NPU_POOL_CACHE", "NPU_POOL_OOM_SNAPSHOT",
                   "NPU_POOL_LOG_EVERY", "NPU_POOL_REPORT_DIR", "NPU_POOL_DEBUG", "NPU_POOL_CI_VENV", "NPU_POOL_TORCH_NPU_PYTHON",
                   "NPU_POOL_SHARED", "NPU_POOL_CUDART")


YAML_MAX_BYTES = 1 << 20   # a settings or model config file is a few hundred bytes
YAML_MAX_DEPTH = 32        # nesting levels of mappings and lists
YAML_MAX_DIGITS = 40       # digits of an integer (2^64 has 20)
_SHOW = 60                 # characters of a value shown in a message


class ConfigError(ValueError):
    """A setting has a value npu_pool does not accept."""


def show(value: Any, limit: int = _SHOW) -> str:
    """``repr(value)`` cut to ``limit`` characters, computed without expanding a large value."""
    if isinstance(value, (dict, list, tuple, set)) and len(value) > 8:
        return f"<a {type(value).__name__} of {len(value)} items>"
    try:
        text = repr(value) if not isinstance(value, (dict, list, tuple, set)) else _short_repr(value, limit)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still shown
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _short_repr(value: Any, limit: int, depth: int = 0) -> str:
    if depth > 3:
        return "..."
    if isinstance(value, dict):
        parts = [f"{_short_repr(k, limit, depth + 1)}: {_short_repr(v, limit, depth + 1)}"
                 for k, v in list(value.items())[:8]]
        return "{" + ", ".join(parts)[:limit] + "}"
    if isinstance(value, (list, tuple, set)):
        return "[" + ", ".join(_short_repr(v, limit, depth + 1) for v in list(value)[:8])[:limit] + "]"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    return repr(value)[:limit]


_DIGITS = re.compile(r"[0-9]+")


def parse_int(value: Any, source: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    """A whole number in [lo, hi] written with ASCII digits (``int()`` and ``str.isdigit``
    accept other digits, e.g. superscripts, that then fail or mean something else)."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    neg = text.startswith("-") and lo < 0
    digits = text[1:] if neg else text
    if not (len(digits) <= 19 and _DIGITS.fullmatch(digits)) or not lo <= (n := int(text)) <= hi:
        raise ConfigError(f"{source}={show(value)} is not valid: use a whole number in {lo}..{hi} (ASCII digits)")
    return n


def load_yaml(path: str, source: str) -> Any:
    """The data of the YAML file ``path``, read safely (see the module's docstring);
    ``source`` names what the file is for in messages (e.g. ``NPU_POOL_CONFIG``)."""
    import yaml

    where = f"{source}={path!r}" if source else str(path)
    try:
        f = open_regular(path)  # a FIFO must not block
    except NotRegularFile:
        raise ConfigError(f"{where}: not a regular file (a device, FIFO or directory); name a YAML file") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read the file ({getattr(e, 'strerror', None) or e})") from None
    with f:
        try:
            raw = f.read(YAML_MAX_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"{where}: cannot read the file ({e.strerror or e})") from None
    if len(raw) > YAML_MAX_BYTES:
        raise ConfigError(f"{where}: more than {YAML_MAX_BYTES} bytes; not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}); "
                          "save it as UTF-8") from None
    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader
    except _Refused as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        first = " ".join(str(e).split())[:200]
        raise ConfigError(f"{where}: not valid YAML ({first})") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply (more than {YAML_MAX_DEPTH} levels)") from None
    except (ValueError, TypeError, OverflowError) as e:
        raise ConfigError(f"{where}: a value cannot be read ({str(e)[:120]})") from None


class _Refused(Exception):
    """A YAML construct the safe loader does not take."""


def _safe_loader() -> type:
    import yaml

    class SafeYaml(yaml.SafeLoader):
        """SafeLoader without aliases or repeated keys, with bounded depth and integer length."""

        _depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise _Refused(f"line {mark.line + 1}: aliases (*name) are not accepted in a config file")
            self._depth += 1
            try:
                if self._depth > YAML_MAX_DEPTH:
                    mark = self.peek_event().start_mark
                    raise _Refused(f"line {mark.line + 1}: nested too deeply (more than {YAML_MAX_DEPTH} levels)")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            first: dict[tuple[str, str], int] = {}  # a key given twice: YAML keeps the last, silently
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode):
                    line = key.start_mark.line + 1
                    if (key.tag, key.value) in first:
                        raise _Refused(f"line {line}: {key.value!r} is given twice (first on line "
                                       f"{first[(key.tag, key.value)]}); give each key once")
                    first[(key.tag, key.value)] = line
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node: Any) -> Any:
            digits = sum(c.isalnum() for c in node.value)
            if digits > YAML_MAX_DIGITS:
                raise _Refused(f"line {node.start_mark.line + 1}: an integer of {digits} digits; "
                               f"at most {YAML_MAX_DIGITS} are accepted")
            return super().construct_yaml_int(node)

    SafeYaml.add_constructor("tag:yaml.org,2002:int", SafeYaml.construct_yaml_int)
    return SafeYaml


_LOADER: list[type] = []


def _loader() -> type:
    """The safe loader class, built on first use (importing this module needs no yaml)."""
    if not _LOADER:
        _LOADER.append(_safe_loader())
    return _LOADER[0]


@dataclass(frozen=True)
class Config:
    """What the environment and the YAML file ask for."""

    enabled: bool = False
    fraction: Optional[float] = None  # None: no cap beyond the device
    policy: str = "npu_pool"
    plan: Optional[str] = None  # plan file for the planned policy
    plan_source: str = PLAN  # where the plan was named: the variable, or the key in the YAML file
    compact: bool = False  # compaction at an out-of-memory (Pool.set_compaction)
    # where the policy and the fraction were set, as written: {POLICY: "NPU_POOL_POLICY='x'", ...};
    # not a setting: two configurations that ask for the same are equal wherever they were written
    origin: Mapping[str, str] = field(default_factory=dict, compare=False)


_BLANK = " \t\n\r\f\v"  # ASCII white space, what a shell or a YAML file leaves around a value
# a decimal number written with ASCII characters (float() also takes other digits and "_")
_NUMBER = re.compile(r"\+?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def parse_enabled(value: Any, source: str = ENABLE) -> bool:
    """``0``/``1`` (YAML booleans too) as a bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip(_BLANK)
    if text in ("0", "1"):
        return text == "1"
    raise ConfigError(f"{source}={show(value)} is not valid: use 0 (off) or 1 (on)")


def parse_fraction(value: Any, source: str = FRACTION) -> float:
    """A number in (0, 1]; a string in ASCII (``float()`` also reads "１" and "0.5_0")."""
    f = math.nan
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            f = float(value)
        elif isinstance(value, str) and _NUMBER.fullmatch(value.strip(_BLANK)):
            f = float(value.strip(_BLANK))
    except OverflowError:  # an integer past float's range
        pass
    if not 0.0 < f <= 1.0:  # also rejects NaN
        raise ConfigError(f"{source}={show(value)} is not valid: use a number in (0, 1], e.g. 0.9")
    return f


def parse_policy(value: Any, source: str = POLICY) -> str:
    """One of :data:`POLICY_NAMES`."""
    text = value.strip() if isinstance(value, str) else None
    if text not in POLICY_NAMES:
        raise ConfigError(f"{source}={show(value)} is not valid: use one of {', '.join(POLICY_NAMES)}")
    return text


def parse_plan(value: Any, source: str = PLAN) -> str:
    """The path of an existing plan file."""
    text = value.strip() if isinstance(value, str) else ""
    why = "is not valid"
    if text and "\0" not in text:
        try:  # (what the file is, as the CLI and the API say it)
            mode = os.stat(text).st_mode
            why = f"is not a regular file ({kind_of(mode)})"
            if stat.S_ISREG(mode):
                return text
        except OSError as e:
            why = f"cannot be read ({e.strerror or e})"
    raise ConfigError(f"{source}={show(value)} {why}: name a plan file written by `npu-pool plan`")


def parse_output_dir(value: str, source: str, *, unwritable_warns: bool = False) -> str:
    """A folder to write into: one that exists, or none yet (made at the first write); never a
    file, a FIFO or a device, nor a folder this process cannot write or make (/proc/x, a name
    too long), found now rather than when the first write is due (hours later). The check makes
    and removes an empty folder where the writes would go. ``unwritable_warns``: a folder that
    cannot be written is a warning, not an error (an optional diagnostic another tool's switch
    turned on: torch_npu's OOM_SNAPSHOT_PATH, the working directory by default); so is a file."""
    if os.path.exists(value) and not os.path.isdir(value):
        message = f"{source}={show(value, 400)} is not a directory: name a folder to write into (made when missing)"
        if not unwritable_warns:
            raise ConfigError(message)
        warnings.warn(f"npu_pool: {message} (nothing will be written there)", RuntimeWarning, stacklevel=3)
        return value
    where = value
    try:
        where = os.path.abspath(value)
        while not os.path.exists(where):  # the nearest folder that exists: the writes make the rest
            where = os.path.dirname(where)
        if any(len(os.fsencode(part)) > 255 for part in value.split(os.sep)) or len(os.fsencode(value)) >= 4096:
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
        if not os.path.isdir(where):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        os.rmdir(tempfile.mkdtemp(prefix=".npu_pool-check-", dir=where))
    except OSError as e:
        message = (f"{source}={show(value, 400)}: cannot be written ({e.strerror or e} in {show(where, 200)}): "
                   "name a folder this process can write")
        if not unwritable_warns:
            raise ConfigError(message) from None
        warnings.warn(f"npu_pool: {message} (nothing will be written there)", RuntimeWarning, stacklevel=3)
    return value


_PARSERS = {ENABLE: parse_enabled, FRACTION: parse_fraction, POLICY: parse_policy, PLAN: parse_plan,
            COMPACT: parse_enabled}


def _read_file(path: str) -> dict[str, tuple[Any, str]]:
    """The YAML file's settings as ``{VARIABLE: (value, source)}``."""
    data = load_yaml(path, CONFIG_FILE)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FILE}={path!r}: expected a mapping of settings, got {type(data).__name__}")
    accepted = {k.lower(): k for k in _KEYS}
    out: dict[str, tuple[Any, str]] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in accepted:
            raise ConfigError(f"{CONFIG_FILE}={path!r}: unknown key {show(key)}; accepted keys: {', '.join(accepted)}")
        if value is not None:
            out[accepted[key]] = (value, f"{key} in {path}")
    return out


def unknown_variables(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """One line for each ``NPU_POOL_*`` variable of the environment that nothing reads (a typo:
    the setting it meant is then silently absent), with the closest known name."""
    import difflib

    env = os.environ if environ is None else environ
    lines = []
    for name in sorted(k for k in env if k.startswith("NPU_POOL_") and k not in KNOWN_VARIABLES):
        close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}? " if close else ""
        lines.append(f"{name} is not a variable npu_pool reads ({hint}it reads {', '.join(KNOWN_VARIABLES[:8])})")
    return lines


def switched_on(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``MEMORY_FRAGMENTATION`` (else the ``NPU_POOL_CONFIG`` file's key) turns the pool on.
    Only the switch is read: with it off, the pool's other settings are not looked at (an A/B run
    flips the one variable and leaves the rest as they are)."""
    env = os.environ if environ is None else environ
    if env.get(ENABLE, "").strip():
        return parse_enabled(env[ENABLE])
    path = env.get(CONFIG_FILE, "").strip()
    value, source = _read_file(path).get(ENABLE, (False, ENABLE)) if path else (False, ENABLE)
    return parse_enabled(value, source)


def _written(value: Any, source: str) -> str:
    """A setting as the user wrote it: ``NPU_POOL_POLICY='x'``, or ``key='x' (in FILE)`` from the YAML file."""
    key, _, path = source.partition(" in ")  # (a key has no blank; _read_file's source is "key in path")
    return f"{key}={show(value)}" + (f" (in {path})" if path else "")


def load(environ: Optional[Mapping[str, str]] = None) -> Config:
    """Read the settings (``environ`` defaults to ``os.environ``)."""
    env = os.environ if environ is None else environ
    raw: dict[str, tuple[Any, str]] = {}
    path = env.get(CONFIG_FILE, "").strip()
    if path:
        raw.update(_read_file(path))
    for key in _KEYS:
        if env.get(key, "").strip():
            raw[key] = (env[key], key)
    values = {key: _PARSERS[key](value, source) for key, (value, source) in raw.items()}
    cfg = Config(enabled=values.get(ENABLE, False), fraction=values.get(FRACTION),
                 policy=values.get(POLICY, "npu_pool"), plan=values.get(PLAN),
                 plan_source=raw[PLAN][1] if PLAN in raw else PLAN, compact=values.get(COMPACT, False),
                 origin={k: _written(*raw[k]) for k in (POLICY, FRACTION) if k in raw})
    if cfg.policy == "planned" and not cfg.plan:
        raise ConfigError(f"{POLICY}=planned needs {PLAN}: the plan file to serve (write one with `npu-pool plan`)")
    if cfg.compact:
        check_compaction(cfg.policy, raw[COMPACT][1])
    return cfg


def check_compaction(policy: str, source: str) -> None:
    """Refuse compaction asked for by ``source`` (a variable or YAML key) under a policy that has none."""
    if policy not in COMPACTING_POLICIES:
        raise ConfigError(f"{source}=1 applies to the npu_pool and planned policies, but the policy is {policy}")
