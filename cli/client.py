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
from google.protobuf.message import Message

from unbroken.cli.main import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE
from unbroken.common import channel
from unbroken.common.tls import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    TlsConfig,
    channel_credentials,
    read_token,
    token_metadata,
)
from unbroken.proto import driver_pb2_grpc as dgrpc

DRIVER_ENV = "UNBROKEN_DRIVER"
DEFAULT_DRIVER = "127.0.0.1:50051"


class CliError(Exception):
    """A failure to report to the operator: a message and the process exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(kw_only=True, slots=True)
class ClientConfig:
    """How to reach the driver."""

    driver: str = DEFAULT_DRIVER
    timeout_s: float = 10.0
    token: str | None = None
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        host, _, port = self.driver.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"driver must be HOST:PORT, got {self.driver!r} (--driver or ${DRIVER_ENV})"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def add_client_flags(parser: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    """The connection flags every operator command shares (names as on `unbroken agent`)."""
    parser.add_argument(
        "--driver",
        default=os.environ.get(DRIVER_ENV, DEFAULT_DRIVER),
        help=f"driver address HOST:PORT (default: ${DRIVER_ENV} or {DEFAULT_DRIVER})",
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="deadline per call in seconds (default 10)"
    )
    parser.add_argument(
        "--token-file",
        default=os.environ.get(TOKEN_FILE_ENV),
        help=f"file holding this client's role token (default ${TOKEN_FILE_ENV}; or the token "
        f"itself in ${TOKEN_ENV}); tokens are never taken from the command line",
    )
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tls-cert", default=None, help="client certificate (mTLS)")
    parser.add_argument("--tls-key", default=None, help="client private key (mTLS)")
    parser.add_argument("--tls-ca", default=None, help="CA that signed the driver's cert")
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def config_from_args(ns: argparse.Namespace) -> ClientConfig:
    """A `ClientConfig` from parsed flags (CliError with exit code 2 on bad input)."""
    try:
        return ClientConfig(
            driver=ns.driver,
            timeout_s=ns.timeout,
            token=read_token(os.environ.get(TOKEN_ENV) or None, ns.token_file, argv_token=ns.token),
            tls=TlsConfig(cert=ns.tls_cert, key=ns.tls_key, ca=ns.tls_ca),
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
        return CliError(
            f"cannot reach the driver at {cfg.driver} ({code.name}: {details[:300]}). "
            f"Is `unbroken driver` running there? Point --driver or ${DRIVER_ENV} at it.",
            EXIT_UNREACHABLE,
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return CliError(
            f"the driver refused the credentials: {details} (--token-file, ${TOKEN_ENV}, --tls-*)",
            EXIT_USAGE,
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return CliError(f"not allowed: {details}", EXIT_USAGE)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
        return CliError(details, EXIT_USAGE)
    return CliError(f"{details} ({code.name})", EXIT_FAILED)


def to_dict(msg: Message) -> dict[str, Any]:
    """A message as JSON-ready data (proto field names, defaults included)."""
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


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
        ch, stub = connect(cfg)
        try:
            return await body(cfg, stub, metadata(cfg))
        except grpc.aio.AioRpcError as e:
            return fail(prog, explain(e, cfg))
        except CliError as e:
            return fail(prog, e)
        finally:
            await ch.close()

    return asyncio.run(main())
