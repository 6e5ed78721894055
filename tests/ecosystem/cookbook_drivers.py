# mypy: disable-error-code="import-not-found"
"""Runs a tinker-cookbook training entry point as a Tinker user's script would, in the cookbook's own virtualenv
(tests/ecosystem/cookbook_venv.py): `python cookbook_drivers.py {sl,rl-sync,rl-async} LOG_DIR`. The service is
found the SDK's way (TINKER_BASE_URL, TINKER_API_KEY), the tokenizer in the Hugging Face cache (HF_HOME, offline).
Sizes are tiny and every run stops after 2 steps; everything else is the cookbook's defaults."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tinker_cookbook import model_info
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

MODEL = "Qwen/Qwen3-4B-Instruct-2507"
STEPS = 2


def synthetic_chats(path: Path, count: int) -> None:
    """Short arithmetic dialogues, one JSON object with "messages" per line (the builder's file format)."""
    with path.open("w") as out:
        for i in range(count):
            a, b = 3 + i, 11 + 2 * i
            messages = [
                {"role": "user", "content": f"What is {a} + {b}?"},
                {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")


def sl(log_path: Path, renderer: str) -> None:
    chats = log_path.parent / f"{log_path.name}-chats.jsonl"
    synthetic_chats(chats, 8)
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=MODEL, renderer_name=renderer, max_length=128, batch_size=4
    )
    config = sl_train.Config(
        log_path=str(log_path),
        model_name=MODEL,
        recipe_name="opentinker_cookbook_sl",
        renderer_name=renderer,
        dataset_builder=FromConversationFileBuilder(file_path=str(chats), common_config=common),
        lora_rank=8,
        save_every=1,
        eval_every=0,
        max_steps=STEPS,
    )
    asyncio.run(sl_train.main(config))


def rl(log_path: Path, renderer: str, *, asynchronous: bool) -> None:
    groups, group_size = 2, 2
    builder = ArithmeticDatasetBuilder(
        batch_size=groups,
        model_name_for_tokenizer=MODEL,
        renderer_name=renderer,
        n_batches=STEPS + 2,
        group_size=group_size,
    )
    config = rl_train.Config(
        learning_rate=1e-4,
        dataset_builder=builder,
        model_name=MODEL,
        recipe_name="opentinker_cookbook_rl",
        renderer_name=renderer,
        max_tokens=5,
        log_path=str(log_path),
        lora_rank=8,
        eval_every=0,
        save_every=1,
        max_steps=STEPS,
        async_config=rl_train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=groups) if asynchronous else None,
    )
    asyncio.run(rl_train.main(config))


def main() -> None:
    mode, log_path = sys.argv[1], Path(sys.argv[2])
    renderer = model_info.get_recommended_renderer_name(MODEL)
    if mode == "sl":
        sl(log_path, renderer)
    elif mode in ("rl-sync", "rl-async"):
        rl(log_path, renderer, asynchronous=mode == "rl-async")
    else:
        raise SystemExit(f"unknown mode {mode!r}: sl, rl-sync or rl-async")


if __name__ == "__main__":
    main()
