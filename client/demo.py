"""`make demo`: the stack on a locally generated model, shown working, shut down cleanly.

It grows with the project: today it builds the tiny model and runs a private Redis, the registry's store.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis
from rich.console import Console

from opentinker.registry.embedded_redis import EmbeddedRedis


def run_demo(workdir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model, model_files_digest

    console = Console()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "tiny-qwen2"
    with console.status("writing tiny qwen2 model"):
        make_tiny_model(model_dir, TinyModelSpec(arch="qwen2", seed=0))
    console.print(f"[green]model[/] {model_dir} digest {model_files_digest(model_dir)[:16]}")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12+7?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    console.print(f"[green]base model[/] greedy continuation: {tokenizer.decode(out[0, ids.shape[1] :])!r}")

    with EmbeddedRedis(workdir / "redis") as server:
        client = redis.Redis.from_url(server.url)
        started = time.perf_counter()
        client.xadd("ot:demo", {"hello": "world"})
        console.print(
            f"[green]embedded redis[/] {server.url} (pid {server.process.pid if server.process else '?'}) "
            f"answered in {(time.perf_counter() - started) * 1000:.1f} ms"
        )
        client.close()
    console.print("[bold green]demo finished[/]")
