"""After etcd is restored from a snapshot: the jobs' leader terms go on above every term the
agents have seen.

Agents take commands only from the newest leader term they have seen, counted within one
term scope: the etcd cluster id and the creation of the job's term key
(driver/election.py `term_scope`). An etcd restored from a snapshot of the same cluster (the
usual disaster recovery: each member restored with its old name, peer URLs and cluster
token) keeps both, while its term key went back to the snapshot's value: every leader it
elects has a term the agents take for a stale leader's, and they refuse its commands until
they restart. A restore into a new cluster id (other names or URLs) changes the scope and
needs nothing: agents count terms afresh there.

So a restore raises every job's term key by `RESTORE_TERM_RAISE`, far above any number of
elections a job can have held since the snapshot (one a second for twelve days), before a
driver campaigns on it: terms stay monotonic within the scope, and a stale leader of the
lost history (its lower term) is still refused.

- `unbroken etcd --restore-from SNAPSHOT --data-dir DIR`: restores a snapshot (`etcdctl
  snapshot save`) into DIR for the embedded single-member etcd (`etcdutl snapshot
  restore`, or etcdctl's for etcd 3.4), raises the terms, and serves it;
- `unbroken etcd --raise-terms-at URLS`: raises the terms of an etcd cluster restored by
  hand (every member restored and started), then exits.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from aetcd import rpc

from unbroken.driver.etcdclient import ROOT, EtcdConfig, connect

RESTORE_TERM_RAISE = 1 << 20


async def raise_terms(
    config: EtcdConfig, by: int = RESTORE_TERM_RAISE
) -> dict[str, tuple[int, int]]:
    """Raise every job's term key in the etcd of `config` by `by`; {job: (old, new)}.

    Each key is written in a transaction on the revision it was read at (a driver that
    campaigns meanwhile wins its own race; the raise is then retried on the newer value).

    Raises:
        LogUnavailableError: etcd is unreachable.
        ValueError: a term key holds no number (the keys are not unbroken's).
    """
    prefix = f"{ROOT}/".encode()
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    client = await connect(config)
    out: dict[str, tuple[int, int]] = {}
    try:
        listed = await client.kvstub.Range(
            rpc.RangeRequest(key=prefix, range_end=end, keys_only=True)
        )
        terms = [
            kv.key for kv in listed.kvs if kv.key.count(b"/") == 3 and kv.key.endswith(b"/term")
        ]
        for key in terms:
            job = key.decode().split("/")[2]
            for _ in range(8):
                r = await client.kvstub.Range(rpc.RangeRequest(key=key))
                if not r.kvs:
                    break
                kv = r.kvs[0]
                try:
                    old = int(kv.value)
                except ValueError:
                    raise ValueError(
                        f"{key.decode()} holds {kv.value[:40]!r}, not a term"
                    ) from None
                new = old + by
                cmp = rpc.Compare(
                    key=key,
                    result=rpc.Compare.CompareResult.EQUAL,
                    target=rpc.Compare.CompareTarget.MOD,
                    mod_revision=kv.mod_revision,
                )
                put = rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=b"%d" % new))
                t = await client.kvstub.Txn(rpc.TxnRequest(compare=[cmp], success=[put]))
                if t.succeeded:
                    out[job] = (old, new)
                    break
    finally:
        await client.close()
    return out


def restore_snapshot(
    snapshot: str | Path,
    data_dir: str | Path,
    *,
    etcdutl: Path,
    name: str = "unbroken",
    peer_url: str = "http://127.0.0.1:2380",
) -> Path:
    """Restore `snapshot` into `data_dir` as `EmbeddedEtcd` lays it out (its member data in
    `data_dir`/member-data), for a single member `name` at `peer_url` (the old member's
    name and peer URL keep its cluster id). Returns the member data dir.

    Raises:
        ValueError: the snapshot is missing, or `data_dir` already holds a member's data
            (a restore never writes over one: move it aside first).
        RuntimeError: the restore tool failed (its output says why).
    """
    snap, member = Path(snapshot), Path(data_dir) / "member-data"
    if not snap.is_file():
        raise ValueError(f"snapshot {str(snap)!r} does not exist (`etcdctl snapshot save FILE`)")
    if member.exists() and any(member.iterdir()):
        raise ValueError(
            f"{member} already holds etcd data: a restore writes a new data dir; move it "
            "aside or give another --data-dir"
        )
    if member.exists():
        member.rmdir()
    member.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(etcdutl), "snapshot", "restore", str(snap), "--data-dir", str(member),
        "--name", name, "--initial-cluster", f"{name}={peer_url}",
        "--initial-advertise-peer-urls", peer_url,
    ]  # fmt: skip
    env = {"ETCDCTL_API": "3"} if etcdutl.name == "etcdctl" else {}
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env}, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{etcdutl.name} snapshot restore failed ({done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[-800:]}"
        )
    return member
