"""Protocol buffers and generated gRPC stubs. Regenerate with `make proto`."""
