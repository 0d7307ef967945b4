"""gRPC channel and server options that both ends of driver.proto must share.

Keepalive pings must be accepted by the server at the rate the client sends them, or the
server answers with GOAWAY "too_many_pings"; keeping both sides' numbers in one place is
how they stay the same. Also the metadata keys of ours and the one loopback test every
"may a token travel in cleartext to this address?" check uses.
"""

from __future__ import annotations

import ipaddress

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: A peer whose process no longer runs (a frozen or paused driver, a host cut off the
#: network: its kernel may still ACK, or nothing comes back at all) is found by these
#: pings: an agent's stream to a frozen leader fails within time + timeout (5 s), in time
#: to reach the standby that took over before it gives the nodes up. gRPC's own ping
#: timeout (`ping_timeout_ms`, 60 s by default) overrides `keepalive_timeout_ms` unless it
#: is set too: with only the latter, a SIGSTOPped driver held its agents for 60-70 s and a
#: job under the new leader failed with every node lost. The pings are answered by gRPC's
#: core threads, not by the event loop: a stalled loop does not miss them.
KEEPALIVE_TIME_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 3_000

COMMON_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    *COMMON_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 5),
]

# one TCP connection per channel (no subchannel sharing between channels to one target)
CLIENT_OPTIONS: list[tuple[str, int]] = [*COMMON_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]

NODE_KEY = "x-unbroken-node"
EPOCH_KEY = "x-unbroken-epoch"
LEADER_KEY = "x-unbroken-leader"
RELAY_KEY = "x-unbroken-relay"  # on Register: the node id of the relay the node heartbeats through
USER_KEY = "x-unbroken-user"  # who the operator is (the CLI sends user@host)


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP, bracketed or not, or `localhost`) is a loopback address."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def endpoint_is_loopback(endpoint: str) -> bool:
    """Whether `host:port` names this host's loopback."""
    return is_loopback(endpoint.rpartition(":")[0])
