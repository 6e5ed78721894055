"""The tinker SDK's protocol under /api/v1: sessions, training and sampling requests, futures, checkpoints."""
