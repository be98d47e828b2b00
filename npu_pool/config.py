"""Settings of the installed allocator, from environment variables and an optional YAML file.

``MEMORY_FRAGMENTATION`` (0/1) turns the pool on when ``mindspeed_patch`` is imported;
``NPU_POOL_FRACTION`` (a number in (0, 1]) caps the memory it may reserve;
``NPU_POOL_POLICY`` (torch, npu_pool, expandable, planned) picks the placement policy;
``NPU_POOL_PLAN`` names the plan file the ``planned`` policy serves (``npu-pool plan``);
``NPU_POOL_CONFIG`` names a YAML file with the same keys in lower case. A variable set
in the environment overrides the file. Any bad value raises :class:`ConfigError`
naming the variable and the accepted values.

Pure Python: importing it needs neither torch nor the compiled core.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

ENABLE = "MEMORY_FRAGMENTATION"
FRACTION = "NPU_POOL_FRACTION"
POLICY = "NPU_POOL_POLICY"
PLAN = "NPU_POOL_PLAN"
CONFIG_FILE = "NPU_POOL_CONFIG"
POLICY_NAMES: tuple[str, ...] = ("torch", "npu_pool", "expandable", "planned")  # the keys of npu_pool.pool.POLICIES
_KEYS = (ENABLE, FRACTION, POLICY, PLAN)


class ConfigError(ValueError):
    """A setting has a value npu_pool does not accept."""


@dataclass(frozen=True)
class Config:
    """What the environment and the YAML file ask for."""

    enabled: bool = False
    fraction: Optional[float] = None  # None: no cap beyond the device
    policy: str = "npu_pool"
    plan: Optional[str] = None  # plan file for the planned policy


def parse_enabled(value: Any, source: str = ENABLE) -> bool:
    """``0``/``1`` (YAML booleans too) as a bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip()
    if text in ("0", "1"):
        return text == "1"
    raise ConfigError(f"{source}={value!r} is not valid: use 0 (off) or 1 (on)")


def parse_fraction(value: Any, source: str = FRACTION) -> float:
    """A number in (0, 1]."""
    try:
        f = float(str(value).strip()) if not isinstance(value, bool) else math.nan
    except ValueError:
        f = math.nan
    if not 0.0 < f <= 1.0:  # also rejects NaN
        raise ConfigError(f"{source}={value!r} is not valid: use a number in (0, 1], e.g. 0.9")
    return f


def parse_policy(value: Any, source: str = POLICY) -> str:
    """One of :data:`POLICY_NAMES`."""
    text = str(value).strip()
    if text not in POLICY_NAMES:
        raise ConfigError(f"{source}={value!r} is not valid: use one of {', '.join(POLICY_NAMES)}")
    return text


def parse_plan(value: Any, source: str = PLAN) -> str:
    """The path of an existing plan file."""
    text = str(value).strip()
    if not os.path.isfile(text):
        raise ConfigError(f"{source}={value!r} is not valid: name a plan file written by `npu-pool plan`")
    return text


_PARSERS = {ENABLE: parse_enabled, FRACTION: parse_fraction, POLICY: parse_policy, PLAN: parse_plan}


def _read_file(path: str) -> dict[str, tuple[Any, str]]:
    """The YAML file's settings as ``{VARIABLE: (value, source)}``."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{CONFIG_FILE}={path!r}: cannot read the file ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{CONFIG_FILE}={path!r}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FILE}={path!r}: expected a mapping of settings, got {type(data).__name__}")
    accepted = {k.lower(): k for k in _KEYS}
    out: dict[str, tuple[Any, str]] = {}
    for key, value in data.items():
        if key not in accepted:
            raise ConfigError(f"{CONFIG_FILE}={path!r}: unknown key {key!r}; accepted keys: {', '.join(accepted)}")
        if value is not None:
            out[accepted[key]] = (value, f"{key} in {path}")
    return out


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
                 policy=values.get(POLICY, "npu_pool"), plan=values.get(PLAN))
    if cfg.policy == "planned" and not cfg.plan:
        raise ConfigError(f"{POLICY}=planned needs {PLAN}: the plan file to serve (write one with `npu-pool plan`)")
    return cfg
