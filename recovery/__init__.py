"""unbroken.recovery."""
