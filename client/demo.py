"""`make demo`: the stack as it runs in production, on a locally generated model.

Starts a registry (with its embedded Redis) and a trainer as real processes, trains two teams' adapters
on one frozen base with supervised fine-tuning, publishes snapshots as registry versions, moves and rolls
back aliases, shows lineage and the event log, then shuts everything down cleanly.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from opentinker.client.launch import ServerProcess, start_registry, start_trainer
from opentinker.client.types import Datum, ModelInput

console = Console()


def arithmetic_examples(count: int, seed: int, op: str) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        answer = a + b if op == "+" else a * b
        examples.append((f"What is {a}{op}{b}?", f"{a}{op}{b}={answer}"))
    return examples


def sft_datum(tokenizer: Any, prompt: str, answer: str) -> Datum:
    """Chat-rendered prompt + answer; only the answer tokens (and its end marker) carry weight 1."""
    prompt_ids: list[int] = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    answer_ids: list[int] = tokenizer.encode(answer + "<|im_end|>\n", add_special_tokens=False)
    full = list(prompt_ids) + list(answer_ids)
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    return Datum(
        model_input=ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:], "weights": weights}
    )


def run_demo(workdir: Path) -> None:
    from transformers import AutoTokenizer

    from opentinker.client import AdamParams, Event, LoraConfig, RegistryClient, ServiceClient
    from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    model_dir = workdir / "tiny-qwen2"
    with console.status("writing a tiny qwen2 model (random weights, BPE tokenizer, chat template)"):
        make_tiny_model(model_dir, TinyModelSpec(arch="qwen2", seed=0, hidden_size=128, intermediate_size=256))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    processes: list[ServerProcess] = []
    try:
        with console.status("starting registry (embedded Redis) and trainer"):
            registry_proc = start_registry(workdir / "registry")
            processes.append(registry_proc)
            trainer_proc = start_trainer(workdir / "trainer", model_dir, registry_proc)
            processes.append(trainer_proc)
        console.print(f"[green]registry[/] {registry_proc.address}   [green]trainer[/] {trainer_proc.address}")

        service = ServiceClient(trainer=trainer_proc.address, registry=registry_proc.address)
        registry = RegistryClient(registry_proc.address)
        info = service.get_trainer_info()
        console.print(f"base model {info.architecture}, {info.num_layers} layers, vocab {info.vocab_size}, "
                      f"digest {info.model_digest[:12]}")  # fmt: skip

        # Two teams, two adapters, one frozen base; different ranks and tasks.
        teams = {
            "team-a/adder": (LoraConfig(rank=8, alpha=16), arithmetic_examples(16, 1, "+")),
            "team-b/multiplier": (
                LoraConfig(rank=4, alpha=8, target_modules=("attn",)),
                arithmetic_examples(16, 2, "*"),
            ),
        }
        clients = {name: service.create_training_client(name, lora, seed=7) for name, (lora, _) in teams.items()}
        batches = {name: [sft_datum(tokenizer, q, a) for q, a in examples] for name, (_, examples) in teams.items()}
        table = Table("step", *teams, title="SFT loss (sum over answer tokens), adapters trained interleaved")
        adam = AdamParams(learning_rate=5e-3)
        started = time.perf_counter()
        for step in range(1, 31):
            losses = []
            for name, client in clients.items():
                result = client.forward_backward(batches[name], trace_ids=[f"{name}-batch-{step}"])
                client.optim_step(adam)
                losses.append(f"{result.loss:.2f}")
            if step in (1, 2, 5, 10, 20, 30):
                table.add_row(str(step), *losses)
            if step == 10:
                first = clients["team-a/adder"].save_snapshot(aliases=["stable"])
        console.print(table)
        console.print(f"60 training steps in {time.perf_counter() - started:.1f} s")

        second = clients["team-a/adder"].save_snapshot()
        console.print(f"[green]published[/] team-a/adder v{first.number} (stable) and v{second.number} (latest), "
                      f"sha256 {second.sha256[:12]}")  # fmt: skip
        clients["team-b/multiplier"].save_snapshot()

        lineage = registry.get_lineage("team-a/adder")
        for version in lineage:
            traces = [t for b in version.lineage.batches for t in b.trace_ids]
            console.print(
                f"  lineage v{version.number}: parent {version.lineage.parent_version or '-'}, "
                f"step {version.lineage.trainer_step}, {len(traces)} batches ({traces[0]} .. {traces[-1]})"
            )

        move = registry.rollback("team-a/adder")
        console.print(f"[yellow]rollback[/] team-a/adder@latest: v{move.previous_version} -> v{move.version}")
        console.print(f"resolve team-a/adder -> v{registry.resolve('team-a/adder').number}")

        console.print("the registry's event log (what samplers follow to hot-reload):")
        events = registry.watch_events(after_id="0", adapters=("team-a/adder",))
        for shown, event in enumerate(events):
            if isinstance(event, Event):
                console.print(f"  {event.event_id} {event.type} {event.adapter} aliases={event.aliases}")
            if shown == 5:
                break
        events.close()

        gc = registry.garbage_collect(keep_last=1, dry_run=True)
        console.print(f"gc --keep 1 (dry run) would collect {len(gc.collected)} versions")
        service.close()
        registry.close()
    finally:
        for process in reversed(processes):
            code = process.terminate()
            console.print(f"stopped {Path(process.ready_file).parent.name} (exit {code})")
    console.print("[bold green]demo finished[/]")
