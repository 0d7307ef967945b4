"""A small gRPC client for the operator commands (`unbroken status`, `nodes`, ...).

Shared by every `driver/cli_*.py` module: the `--driver/--token/--tls-*` flags (the same
names the agent uses), a channel with the job's credentials and the caller's identity,
one deadline per call, and the translation of gRPC statuses into the exit codes of
driver/cli.py with a message that says what to do.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from unbroken.cli import settings, tlsprobe
from unbroken.cli.main import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE
from unbroken.common import channel
from unbroken.common.channel import endpoint_is_loopback
from unbroken.common.tls import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    TlsConfig,
    channel_credentials,
    read_token,
    token_metadata,
)
from unbroken.proto import driver_pb2_grpc as dgrpc

DRIVER_ENV = settings.ENV["driver"]
DEFAULT_DRIVER = settings.DEFAULT_DRIVER


class CliError(Exception):
    """A failure to report to the operator: a message and the process exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(kw_only=True, slots=True)
class ClientConfig:
    """How to reach the driver: its addresses (a leader and standbys) and credentials."""

    driver: str = DEFAULT_DRIVER  # the one being called now
    drivers: tuple[str, ...] = ()  # every address given, in order (default: `driver`)
    timeout_s: float = 10.0
    token: str | None = None
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        if not self.drivers:
            self.drivers = (self.driver,)
        for d in self.drivers:
            host, _, port = d.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"driver must be HOST:PORT, got {d!r} (--driver, ${DRIVER_ENV} or the "
                    "config file's driver)"
                )
        if self.driver not in self.drivers:
            self.driver = self.drivers[0]
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    def may_follow(self, leader: str) -> bool:
        """Whether our credentials may go to `leader`, an address a driver named: one we
        were given, a verified TLS peer, or a loopback address."""
        return leader in self.drivers or self.tls.enabled or endpoint_is_loopback(leader)


def add_client_flags(parser: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    """The connection flags every operator command shares (names as on `unbroken agent`).

    Each falls back to its environment variable, then to the CLI config file
    (cli/settings.py), then to its default.
    """
    env = settings.ENV
    parser.add_argument(
        "--driver",
        action="append",
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help=f"driver addresses: the leader and its standbys, repeated or comma-separated; "
        f"a standby's answer is followed to the leader (default: ${DRIVER_ENV}, the config "
        f"file's driver, or {DEFAULT_DRIVER})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"deadline per call in seconds (default: ${env['timeout']}, the config file, 10)",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        help=f"file holding this client's role token (default ${TOKEN_FILE_ENV} or the config "
        f"file's token-file; or the token itself in ${TOKEN_ENV}); tokens are never taken from "
        "the command line",
    )
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--tls-cert", default=None, help=f"client certificate (mTLS; default ${env['cert']})"
    )
    parser.add_argument(
        "--tls-key", default=None, help=f"client private key (mTLS; default ${env['key']})"
    )
    parser.add_argument(
        "--tls-ca", default=None, help=f"CA that signed the driver's cert (default ${env['ca']})"
    )
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def config_from_args(ns: argparse.Namespace) -> ClientConfig:
    """A `ClientConfig` from parsed flags, the environment and the config file (CliError
    with exit code 2 on bad input)."""
    try:
        got = settings.resolve(
            {
                "driver": ns.driver,
                "timeout": ns.timeout,
                "token_file": ns.token_file,
                "cert": ns.tls_cert,
                "key": ns.tls_key,
                "ca": ns.tls_ca,
            }
        )
        return ClientConfig(
            drivers=got.drivers,
            timeout_s=got.timeout_s,
            token=read_token(
                os.environ.get(TOKEN_ENV) or None, got.token_file, argv_token=ns.token
            ),
            tls=TlsConfig(cert=got.cert, key=got.key, ca=got.ca),
        )
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from e


def connect(cfg: ClientConfig) -> tuple[grpc.aio.Channel, dgrpc.DriverStub]:
    """A channel to the driver (TLS when configured) and the Driver stub on it."""
    if cfg.tls.enabled:
        ch = grpc.aio.secure_channel(
            cfg.driver, channel_credentials(cfg.tls), options=channel.CLIENT_OPTIONS
        )
    else:
        ch = grpc.aio.insecure_channel(cfg.driver, options=channel.CLIENT_OPTIONS)
    return ch, dgrpc.DriverStub(ch)


def metadata(cfg: ClientConfig) -> tuple[tuple[str, str], ...]:
    """Call metadata: the bearer token and who is asking (for OperatorAction events)."""
    try:
        user = f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):
        user = f"uid{os.getuid()}@{socket.gethostname()}"
    return (*token_metadata(cfg.token), (channel.USER_KEY, user))


def explain(e: grpc.aio.AioRpcError, cfg: ClientConfig) -> CliError:
    """The operator-facing message and exit code of a failed call."""
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and "etcd" in details:
        return CliError(
            f"the driver at {cfg.driver} cannot reach its etcd: {details[:300]}",
            EXIT_UNREACHABLE,
        )
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        cause = tlsprobe.diagnose(cfg.driver, cfg.tls, min(cfg.timeout_s, 5.0))
        if cause is not None:
            return CliError(f"cannot reach the driver at {cfg.driver}: {cause}", EXIT_UNREACHABLE)
        return CliError(
            f"cannot reach the driver at {cfg.driver} ({code.name}: {details[:300]}). "
            f"Is `unbroken driver` running there? Point --driver or ${DRIVER_ENV} at it.",
            EXIT_UNREACHABLE,
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return CliError(
            f"unauthorised: the driver at {cfg.driver} refused the credentials: {details} "
            f"(--token-file, ${TOKEN_ENV}, --tls-*)",
            EXIT_USAGE,
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return CliError(f"unauthorised: not allowed: {details}", EXIT_USAGE)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
        return CliError(details, EXIT_USAGE)
    return CliError(f"{details} ({code.name})", EXIT_FAILED)


def to_dict(msg: Message) -> dict[str, Any]:
    """A message as JSON-ready data (proto field names, defaults included).

    64-bit integers are numbers, not the strings of protobuf's JSON mapping (which guards
    JavaScript's 53-bit doubles): `jq '.seq > 100'` and Python's json compare them as
    numbers, and every value we carry (steps, sequence numbers, bytes, ns) fits.
    """
    data = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _int64_as_numbers(msg.DESCRIPTOR, data)
    return data


_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _int64_as_numbers(desc: Any, data: dict[str, Any]) -> None:
    """Turn the int64 strings of `data` (MessageToDict of a `desc` message) into ints."""

    def number(v: Any) -> Any:
        return int(v) if isinstance(v, str) else v

    for fd in desc.fields:
        if fd.name not in data:
            continue
        v = data[fd.name]
        mt = fd.message_type
        if mt is not None and mt.GetOptions().map_entry:
            kf, vf = mt.fields_by_name["key"], mt.fields_by_name["value"]
            if vf.type in _INT64:
                v = {k: number(x) for k, x in v.items()}
            elif vf.message_type is not None:
                for x in v.values():
                    if isinstance(x, dict):
                        _int64_as_numbers(vf.message_type, x)
            del kf  # map keys stay strings (JSON object keys)
            data[fd.name] = v
        elif mt is not None:
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, dict) and mt.full_name.startswith("unbroken."):
                    _int64_as_numbers(mt, x)
        elif fd.type in _INT64:
            data[fd.name] = [number(x) for x in v] if isinstance(v, list) else number(v)


#: a piped table's width: each row on one line, whole (`| grep`, `| less -S`), never cut
PIPED_WIDTH = 1000


def console(**kw: Any) -> Any:
    """A rich Console for tables: the terminal's width on a terminal, wide when piped.

    rich falls back to 80 columns when stdout is not a terminal, which cut a piped
    `unbroken nodes` mid-row; `$COLUMNS` still wins when set.
    """
    from rich.console import Console

    stream_tty = (sys.stderr if kw.get("stderr") else sys.stdout).isatty()
    wide = not stream_tty and not os.environ.get("COLUMNS")
    return Console(width=PIPED_WIDTH if wide else None, **kw)


def print_json(data: Any) -> None:
    """One JSON document on stdout (one line, so `--follow` output is JSON lines)."""
    sys.stdout.write(json.dumps(data, sort_keys=True) + "\n")
    sys.stdout.flush()


def fail(prog: str, err: CliError) -> int:
    """Print `err` for the operator and return its exit code."""
    print(f"unbroken {prog}: {err}", file=sys.stderr)
    return err.exit_code


Command = Callable[[ClientConfig, dgrpc.DriverStub, tuple[tuple[str, str], ...]], Awaitable[int]]


def run_command(prog: str, ns: argparse.Namespace, body: Command) -> int:
    """Thin shell of an operator command: flags -> channel -> body -> exit code; always close.

    Args:
        prog: the subcommand's name, for messages.
        ns: parsed flags (with the client flags).
        body: the command; gets the config, the stub and the call metadata.

    Returns:
        The exit code: the body's, or that of the error it raised.
    """
    try:
        cfg = config_from_args(ns)
    except CliError as e:
        return fail(prog, e)

    async def main() -> int:
        tried: list[str] = []
        while True:
            ch, stub = connect(cfg)
            try:
                return await body(cfg, stub, metadata(cfg))
            except grpc.aio.AioRpcError as e:
                tried.append(cfg.driver)
                nxt = _next_driver(e, cfg, tried)
                if nxt is None:
                    return fail(prog, explain(e, cfg))
                cfg.driver = nxt
            except CliError as e:
                return fail(prog, e)
            finally:
                await ch.close()

    return asyncio.run(main())


def _next_driver(e: grpc.aio.AioRpcError, cfg: ClientConfig, tried: list[str]) -> str | None:
    """The driver to call next after `e` (None: report `e`).

    A standby answers with the leader's address in a trailer: follow it when our
    credentials may go there (`ClientConfig.may_follow`). An unreachable driver: the next
    address given. Each address is tried once per command.
    """
    code = e.code()
    trailers = dict(e.trailing_metadata() or ())
    leader = str(trailers.get(channel.LEADER_KEY, "") or "")
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE) and leader:
        if leader not in tried and cfg.may_follow(leader):
            return leader
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
        if code == grpc.StatusCode.FAILED_PRECONDITION and channel.LEADER_KEY not in trailers:
            return None  # a refusal of the leader itself, not a standby's
        rest = [d for d in cfg.drivers if d not in tried]
        if rest:
            return rest[0]
    return None
