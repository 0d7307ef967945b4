"""unbroken.diagnostics."""
