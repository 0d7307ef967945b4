"""Runnable examples: a plain DDP script, and the same script made fault tolerant by the SDK."""
