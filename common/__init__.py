"""What every unbroken process shares that is not a wire format.

- `channel`: gRPC channel and server options, metadata keys (both ends must agree).
- `tls`: TLS credentials from certificate files and bearer-token loading (one rule for
  every client and server: all three files or none, tokens of 16+ characters, never argv).
- `paths`: the private runtime directory and the agent's default socket.
- `workerenv`: the agent -> worker environment contract (`WorkerEnv`).
- `faults`: the fault-spec format and the kinds of injectable faults.
- `serving`: what every gRPC server of ours does to a request first (malformed bytes get
  INVALID_ARGUMENT).
- `config`: command-line flags generated from config dataclasses (help in field metadata).
- `loopthread`: an asyncio loop on its own thread, optionally at a lower priority.
- `logsetup`: structlog set-up; `reaper`: the watcher that takes a process's children down
  with it.

It imports nothing of ours but `unbroken.proto`; every other part may import it.
"""
