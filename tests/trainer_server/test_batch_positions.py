"""build_batch counts padded positions (datums x longest datum), not only real tokens, before any tensor."""

from __future__ import annotations

import pytest
from trainerutil import sft_datum

from opentinker.rpc.serving.errors import ResourceExhausted
from opentinker.trainer_server.batch import DEFAULT_MAX_BATCH_POSITIONS, Batch, build_batch
from opentinker.trainer_server.wire import datums_of
from opentinker.v1 import common_pb2


def padded(short: int, long: int = 2049) -> list[common_pb2.Datum]:
    return [sft_datum(list(range(3, 3 + long))), *(sft_datum([5, 6]) for _ in range(short))]


def build(datums: list[common_pb2.Datum], limit: int = DEFAULT_MAX_BATCH_POSITIONS) -> Batch:
    return build_batch(
        datums_of(datums), "cross_entropy", vocab_size=4096, max_positions=4096, pad_id=0, max_batch_positions=limit
    )


def test_a_batch_at_the_limit_is_built() -> None:
    assert DEFAULT_MAX_BATCH_POSITIONS == 64 * 2048
    batch = build(padded(63))  # 64 x 2048 padded positions, 2,111 real tokens
    assert tuple(batch.input_ids.shape) == (64, 2048)


@pytest.mark.parametrize(
    ("short", "limit"), [(64, DEFAULT_MAX_BATCH_POSITIONS), (4095, DEFAULT_MAX_BATCH_POSITIONS), (3, 4 * 2048 - 1)]
)
def test_padding_beyond_the_limit_is_refused(short: int, limit: int) -> None:
    with pytest.raises(ResourceExhausted) as caught:
        build(padded(short), limit)
    assert caught.value.reason == "BATCH_TOO_LARGE" and "--max-batch-positions" in str(caught.value)
