"""unbroken.driver."""
