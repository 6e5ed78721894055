"""`EngineAPI`: what the servicer, the metrics collector and the server builder call on an engine, whether it
runs in the server process (`engine.Engine`) or in a process of its own (`engine_process.EngineProcess`)."""

from __future__ import annotations

import concurrent.futures
from typing import Protocol

from opentinker.sampler_server.engine_stats import EngineStats
from opentinker.sampler_server.kernels import Kernel
from opentinker.sampler_server.sequence import Sequence
from opentinker.sampler_server.updates import UpdateCallback


class EngineAPI(Protocol):
    # Thread-safe entry points; answers come through the callbacks, on the engine's (or its reader's) thread.
    def submit(self, sequences: list[Sequence], on_update: UpdateCallback) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def finish(self, request_id: str, sample_index: int) -> None:
        """Ends one sample the server has ended (a stop string): its sequence is freed, no more updates come."""
        ...

    def score(
        self, tokens: list[int], lora_slot: int, cache_key: str = "", tenant: str = ""
    ) -> concurrent.futures.Future[list[float]]:
        """Logprobs of tokens[1:] under the adapter in `lora_slot`; the engine ends the caller's pin on it. Its
        full blocks join the prefix cache under `cache_key` (the weights identity; "": not cached). Scheduled
        like a prompt in `tenant`'s share of the batch; cancelling the future drops it."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    # What it is and how busy it is
    @property
    def kernel(self) -> Kernel:
        """The LoRA kernel the engine runs (GetSamplerInfo reports it)."""
        ...

    @property
    def max_len(self) -> int: ...

    @property
    def max_seqs(self) -> int: ...

    @property
    def max_batch_tokens(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def stats(self) -> EngineStats: ...
