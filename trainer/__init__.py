"""unbroken.trainer."""
