"""unbroken.agent."""
