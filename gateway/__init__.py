"""Tinker-compatible HTTP gateway: the tinker SDK's protocol translated to the trainer, sampler and registry."""
