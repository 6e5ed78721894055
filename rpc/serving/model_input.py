"""The token ids of a wire `ModelInput`: the trainer's datums and the sampler's prompts both arrive as one."""

from __future__ import annotations

from opentinker.v1 import common_pb2


def tokens_of(model_input: common_pb2.ModelInput) -> list[int]:
    """All chunks' encoded tokens, in order."""
    tokens: list[int] = []
    for chunk in model_input.chunks:
        tokens.extend(chunk.encoded_text.tokens)
    return tokens
