"""Run `unbroken driver` with two recorders, so the chaos checks see the driver's side.

    python tests/chaos/driverprobe.py <record-dir> driver --job-id ... (the CLI's flags)

1. Acknowledgements: every `EtcdEventLog.append_many` that returned (the moment a caller
   is told "durable") writes one line `seq event_id writer` per event to
   `<record-dir>/acks-<pid>.txt` with one unbuffered O_APPEND write, before the caller
   sees the result. A SIGKILL after the write loses nothing; a SIGKILL before it means
   the append was never acknowledged to anyone.
2. The journal's live state: every time the journal folds recorded events into the state
   the recovery loop decides on, the state (a serialized `JobState`) is appended to
   `<record-dir>/states-<pid>.bin` as a length-prefixed record. The check folds the log
   from seq 1 to each record's `last_seq` and requires the very same message.

Nothing is replaced: the real methods run, the recorders only observe their results.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Iterable
from typing import Any


def install(record_dir: str) -> None:
    """Wrap the append and the journal's fold with recorders writing under `record_dir`."""
    from unbroken.driver import journal as journallib
    from unbroken.driver.etcdlog import EtcdEventLog
    from unbroken.proto import events_pb2 as ev

    pid = os.getpid()
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    acks = os.open(os.path.join(record_dir, f"acks-{pid}.txt"), flags, 0o644)
    states = os.open(os.path.join(record_dir, f"states-{pid}.bin"), flags, 0o644)
    append_many = EtcdEventLog.append_many
    notify = journallib.Journal._notify

    async def recorded_append_many(self: EtcdEventLog, events: Iterable[ev.Event]) -> Any:
        stored = await append_many(self, events)
        writer = self.leadership.driver_id if self.leadership else "-"
        os.write(acks, "".join(f"{e.seq} {e.event_id} {writer}\n" for e in stored).encode())
        return stored

    last = [0]

    def recorded_notify(self: journallib.Journal, events: list[ev.Event]) -> None:
        notify(self, events)
        if self.state.last_seq != last[0]:
            last[0] = self.state.last_seq
            data = self.state.SerializeToString()
            os.write(states, struct.pack("<I", len(data)) + data)

    EtcdEventLog.append_many = recorded_append_many  # type: ignore[method-assign]
    journallib.Journal._notify = recorded_notify  # type: ignore[method-assign]


def read_acks(record_dir: str) -> list[tuple[int, str, str]]:
    """Every acknowledged (seq, event_id, writer) of every driver process in `record_dir`."""
    out = []
    for name in sorted(os.listdir(record_dir)):
        if name.startswith("acks-"):
            with open(os.path.join(record_dir, name)) as f:
                for line in f:
                    seq, event_id, writer = line.split()
                    out.append((int(seq), event_id, writer))
    return out


def read_states(record_dir: str) -> list[bytes]:
    """Every recorded loop state (serialized `JobState`) of every driver process."""
    out = []
    for name in sorted(os.listdir(record_dir)):
        if name.startswith("states-"):
            with open(os.path.join(record_dir, name), "rb") as f:
                data = f.read()
            i = 0
            while i + 4 <= len(data):
                (n,) = struct.unpack_from("<I", data, i)
                if i + 4 + n > len(data):
                    break  # the tail a SIGKILL cut short
                out.append(data[i + 4 : i + 4 + n])
                i += 4 + n
    return out


def main(argv: list[str]) -> int:
    """`driverprobe.py <record-dir> driver ...`: install the recorders, run the CLI."""
    install(argv[0])
    from unbroken.cli.main import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
