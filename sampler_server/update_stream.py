"""What the Sample handler streams, on its way from the engine to the client: the engine thread's updates
carried to the event loop (`Mailbox`), those that queued up merged per sample (`coalesce`), and each cut at the
token that completes a stop string (`with_text`, with the text detokenizer.py decodes)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from opentinker.sampler_server.detokenizer import StreamText
from opentinker.sampler_server.sequence import StopReason
from opentinker.sampler_server.updates import SequenceUpdate


def coalesce(updates: list[SequenceUpdate]) -> list[SequenceUpdate]:
    """Updates that queued up while the client was reading, merged into one per sample (in the order each sample
    first appears), so a lagging client gets one message with several tokens instead of a backlog of one-token
    messages. A sample's tokens, logprobs and top logprobs stay in order; an error is kept."""
    merged: dict[int, SequenceUpdate] = {}
    for new in updates:
        index = new.sample_index
        old = merged.get(index)
        merged[index] = (
            new
            if old is None
            else SequenceUpdate(
                new.request_id,
                index,
                old.tokens + new.tokens,
                old.logprobs + new.logprobs,
                new.finished,
                new.stop_reason,
                old.prompt_logprobs,
                new.error or old.error,
                new.error_reason or old.error_reason,
                new.prompt_sources,
                old.top_logprobs + new.top_logprobs,
            )
        )
    return list(merged.values())


def with_text(update: SequenceUpdate, stream: StreamText) -> tuple[SequenceUpdate, str]:
    """One sample's update and the text its tokens add; cut after the token that completes a stop string (then
    finished with StopReason.STOP_STRING, unless that token is the stop token that ended it anyway)."""
    fed = stream.feed(update.tokens, final=update.finished)
    if fed.stop_at is None:
        return update, fed.text
    keep = fed.stop_at + 1
    last = update.finished and keep == len(update.tokens)
    by_token = last and update.stop_reason == StopReason.STOP_TOKEN
    cut = dataclasses.replace(
        update,
        tokens=update.tokens[:keep],
        logprobs=update.logprobs[:keep],
        top_logprobs=update.top_logprobs[:keep],
        finished=True,
        stop_reason=update.stop_reason if by_token else StopReason.STOP_STRING,
    )
    return cut, fed.text


class Mailbox:
    """Carries the engine thread's updates to the event loop's request queues with one loop wake-up for all the
    updates of a step instead of one per token per stream (each wake-up is a self-pipe write plus a GIL hand-off
    between the two threads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[SequenceUpdate], SequenceUpdate]] = []

    def post(self, updates: asyncio.Queue[SequenceUpdate], update: SequenceUpdate) -> None:  # engine thread
        with self._lock:
            self._pending.append((updates, update))
            if len(self._pending) > 1:
                return  # a delivery is already scheduled and will take this one too
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # event loop
        with self._lock:
            pending, self._pending = self._pending, []
        for updates, update in pending:
            updates.put_nowait(update)
