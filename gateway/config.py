"""The gateway's flags (``opentinker gateway serve --help``), which both surfaces read."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_STABILITY_TTL_SECONDS = 86400.0
DEFAULT_MAX_TENANT_STABILITY_TOKENS = 1 << 22  # prompt + sampled tokens one tenant's records hold (about 40 MB)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The gateway's flags (``opentinker gateway serve --help``); the bounds keep one key from holding the
    event loop or the memory every other key shares."""

    fwdbwd_max_chunk_len: int = 1024  # datums per forward_backward request the SDK sends
    compress_fwdbwd: bool = True  # ask the SDK to zstd-compress forward_backward bodies
    default_max_tokens: int = 16  # when SamplingParams.max_tokens is None
    poll_seconds: float = 20.0  # longest retrieve_future long-poll
    max_num_samples: int = 64  # samples per asample (the sampler's own limit)
    max_body_bytes: int = 64 << 20  # a forward_backward body, sent and decompressed
    max_json_bytes: int = 8 << 20  # a JSON body
    max_string_length: int = 4096  # characters of any string (or key) in a JSON body
    seq_window: int = 256  # how far ahead of a model's next expected seq_id a request may be
    max_pending_bytes: int = 256 << 20  # forward_backward bytes one model may have waiting for their turn
    max_tenant_pending_bytes: int = 1 << 30  # ... and all models of one tenant together
    max_sessions_per_tenant: int = 1024  # sessions one tenant holds at once (finished ones count until they expire)
    max_inflight_per_tenant: int = 4096  # unfinished requests of one tenant (429, retried by the SDK, beyond)
    pending_ttl_seconds: float = 300.0  # how long a request may wait for an earlier seq_id that never comes
    session_ttl_seconds: float = 900.0  # a session without heartbeats expires (the SDK sends one every 10 s)
    max_tenant_result_bytes: int = 1 << 30  # finished results one tenant holds (its oldest dropped beyond); 0: none
    checkpoint_gc_seconds: float = 60.0  # how often expired and deleted checkpoints are deleted for real
    stability_ttl_seconds: float = (
        DEFAULT_STABILITY_TTL_SECONDS  # a stability record is kept this long after its last use
    )
    max_tenant_stability_tokens: int = DEFAULT_MAX_TENANT_STABILITY_TOKENS  # tokens one tenant's stability records hold
    tool_call_parser: str = "auto"  # /v1 tool calls: auto (from the chat template), hermes, llama3, none
    max_tokenizer_jobs_per_tenant: int = 64  # /v1 renders one tenant may have waiting for the tokenizer (429 beyond)

    def limits(self) -> dict[str, float]:
        """The numeric flags that must be positive (those where 0 means "no limit" are left out)."""
        return {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if isinstance(getattr(self, name), int | float)
            and not isinstance(getattr(self, name), bool)
            and name not in ZERO_MEANS_NO_LIMIT
        }


ZERO_MEANS_NO_LIMIT = frozenset({"max_tenant_result_bytes"})
