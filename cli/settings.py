"""Where an operator command's connection settings come from: flag, environment, file.

Like etcdctl and kubectl, the CLI does not need the driver's address and the TLS files
repeated on every call. Each setting is taken from the first of:

1. its flag (`--driver`, `--tls-cert`, ...);
2. its environment variable (`ENV` below: `UNBROKEN_DRIVER`, `UNBROKEN_CERT`, ...);
3. the config file: `$UNBROKEN_CLI_CONFIG`, else `$XDG_CONFIG_HOME/unbroken/cli.toml`
   (`~/.config/unbroken/cli.toml`), a TOML file of the same keys:

       driver = ["10.0.0.1:50051", "10.0.0.2:50051"]   # or one "host:port" string
       ca = "/etc/unbroken/pki/ca.pem"
       cert = "/etc/unbroken/pki/operator-me.crt"
       key = "/etc/unbroken/pki/operator-me.key"
       token-file = "/etc/unbroken/operator.token"
       timeout = 10

4. the default (the driver at 127.0.0.1:50051, plaintext, no token, 10 s).

Relative paths in the file are relative to the file's folder. A token is never read from
the file itself, only from the file it names (or from `$UNBROKEN_TOKEN`).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_ENV = "UNBROKEN_CLI_CONFIG"
#: setting -> its environment variable
ENV: Mapping[str, str] = {
    "driver": "UNBROKEN_DRIVER",
    "ca": "UNBROKEN_CA",
    "cert": "UNBROKEN_CERT",
    "key": "UNBROKEN_KEY",
    "token_file": "UNBROKEN_TOKEN_FILE",
    "timeout": "UNBROKEN_TIMEOUT",
}
FILE_KEYS = {"driver", "ca", "cert", "key", "token-file", "timeout"}
PATH_KEYS = {"ca", "cert", "key", "token_file"}
DEFAULT_DRIVER = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Resolved:
    """The effective connection settings, and where each came from (for error messages)."""

    drivers: tuple[str, ...]
    ca: str | None
    cert: str | None
    key: str | None
    token_file: str | None
    timeout_s: float
    source: Mapping[str, str]  # setting -> "flag", "$VAR", the file's path, or "default"


def config_path(env: Mapping[str, str]) -> Path:
    """The CLI's config file (it need not exist)."""
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV])
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "unbroken" / "cli.toml"


def load_file(path: Path, *, required: bool) -> dict[str, Any]:
    """The settings of the TOML file at `path` (keys with `_`), paths made absolute.

    Raises:
        ValueError: the file is not TOML, names an unknown key, or holds a bad value; or
            it is missing and `required`.
    """
    if not path.is_file():
        if required:
            raise ValueError(f"the CLI config file {str(path)!r} (${CONFIG_ENV}) does not exist")
        return {}
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, OSError) as e:
        raise ValueError(f"the CLI config file {str(path)!r} is not valid TOML: {e}") from e
    unknown = sorted(set(raw) - FILE_KEYS)
    if unknown:
        raise ValueError(
            f"the CLI config file {str(path)!r} has unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(FILE_KEYS))}"
        )
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name == "driver":
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise ValueError(f'{path}: driver must be "host:port" or a list of them')
            out[name] = ",".join(items)
        elif name == "timeout":
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{path}: timeout must be a number of seconds")
            out[name] = str(value)
        else:
            if not isinstance(value, str):
                raise ValueError(f"{path}: {key} must be a path (a string)")
            out[name] = str((path.parent / Path(value).expanduser()).resolve())
    return out


def split_drivers(values: list[str]) -> tuple[str, ...]:
    """Driver addresses from repeated and comma-separated values, in order, deduplicated."""
    out: list[str] = []
    for v in values:
        for a in v.split(","):
            a = a.strip()
            if a and a not in out:
                out.append(a)
    return tuple(out)


def resolve(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Resolved:
    """The effective settings from the flags (None: not given), `env` and the config file.

    Raises:
        ValueError: a bad config file or a timeout that is not a number.
    """
    env = os.environ if env is None else env
    path = config_path(env)
    file = load_file(path, required=bool(env.get(CONFIG_ENV)))
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name in ("driver", "ca", "cert", "key", "token_file", "timeout"):
        flag = flags.get(name)
        if flag not in (None, [], ""):
            values[name], source[name] = flag, "flag"
        elif env.get(ENV[name]):
            values[name], source[name] = env[ENV[name]], f"${ENV[name]}"
        elif name in file:
            values[name], source[name] = file[name], str(path)
        else:
            source[name] = "default"
    drivers = values.get("driver", DEFAULT_DRIVER)
    drivers = split_drivers(drivers if isinstance(drivers, list) else [str(drivers)])
    timeout = values.get("timeout", DEFAULT_TIMEOUT_S)
    try:
        timeout_s = float(timeout)
    except ValueError:
        raise ValueError(f"timeout {timeout!r} ({source['timeout']}) is not a number") from None
    return Resolved(
        drivers=drivers or (DEFAULT_DRIVER,),
        ca=values.get("ca"),
        cert=values.get("cert"),
        key=values.get("key"),
        token_file=values.get("token_file"),
        timeout_s=timeout_s,
        source=source,
    )
