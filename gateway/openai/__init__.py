"""The OpenAI-compatible API under /v1: models, chat completions and completions on the sampler."""
