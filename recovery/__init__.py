"""unbroken.recovery: the library the agent and the trainer use to survive failures.

- `flash`: per-rank, double-buffered flash copies in agent-owned shared memory
  (`FlashOwner` for the agent, `FlashWriter` for the worker; `save_async` overlaps the
  copy with the next step). `flashcopy`: the copy format (manifest, checksum, verify).
- `persist`: background persistence to fsspec storage, checksum-verified, commit tracking.
- `replica`: buddy replicas over TCP on a ring of nodes.
- `restore`: the pure restore decision (step, source per rank, storage readers).
- `sources`: survey and open copies with checksum verification and fallback.
- `reshard`: a torch.distributed.checkpoint StorageReader over flash copies.
- `spike`: loss-spike detection and the rollback/skip policy.

Nothing here imports `unbroken.driver` or `unbroken.agent`.
"""
