"""`make demo`: the whole system as it runs in production, on a locally generated tiny model.

Starts a registry (embedded Redis), a trainer and a sampler as real processes on free ports. Then, all at
once on the one frozen base model: three tenants' adapters learn different tasks by RL, a fourth adapter is
trained by SFT on conversations, and two adapters learn against each other in a two-agent game. Every step
samples from the exact version the previous step saved; the sampler hot-reloads each new version as the
registry announces it. At the end: a summary table, one adapter's lineage, a rollback taking effect,
`demo_out/curves.png` and `demo_out/metrics.jsonl`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from opentinker.cli.launch import ServerProcess, start_registry, start_sampler, start_trainer

console = Console()

RL_TASKS = {  # adapter -> (task name, task class name in opentinker.client.tasks)
    "team-a/digits": ("answer with digits", "DigitsTask"),
    "team-b/short": ("answer briefly, then stop", "ShortAnswerTask"),
    "team-c/vowels": ("use many vowels", "VowelsTask"),
}
SFT_ADAPTER = "team-d/chat"
GAME = {"speaker": "team-e/speaker", "listener": "team-e/listener"}


def sft_conversations() -> list[list[dict[str, str]]]:
    pairs = [(f"What is {a}+{b}?", f"{a + b}") for a in range(2, 9) for b in (3, 5)]
    return [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in pairs]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def scrape(metrics_address: str | None, name: str) -> float:
    if metrics_address is None:
        return 0.0
    body = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def plot(curves: dict[str, tuple[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rewards, losses) = plt.subplots(1, 2, figsize=(12, 4.5))
    for adapter, (kind, values) in curves.items():
        axis = losses if kind == "loss" else rewards
        axis.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=adapter)
    rewards.set(title="RL: mean reward per step", xlabel="step", ylabel="reward")
    losses.set(title="SFT: loss per trained token", xlabel="step", ylabel="loss")
    for axis in (rewards, losses):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


async def train_everything(service: Any, renderer: Any, steps: int, progress: Progress) -> dict[str, list[Any]]:
    from opentinker.client import AdamParams, LoraConfig, train_multi_agent_rl_async, train_rl_async, train_sft
    from opentinker.client import tasks as task_module

    # Seeded sampling makes a run repeatable.
    sampling = dataclasses.replace(task_module.TINY_MODEL_SAMPLING, seed=7)
    lora = LoraConfig(rank=8, alpha=16)
    rl_jobs = [
        train_rl_async(
            service,
            adapter,
            getattr(task_module, task_class).factory(renderer),
            steps=steps,
            group_size=8,
            groups_per_step=4,
            sampling=sampling,
            adam=AdamParams(learning_rate=3e-2),
            lora=lora,
            seed=i,
            progress=progress,
        )
        for i, (adapter, (_task, task_class)) in enumerate(RL_TASKS.items())
    ]
    game = train_multi_agent_rl_async(
        service,
        GAME,
        task_module.EchoGame.factory(renderer),
        steps=steps,
        group_size=8,
        groups_per_step=4,
        sampling=sampling,
        adam=AdamParams(learning_rate=3e-2),
        lora=lora,
        progress=progress,
    )
    sft = asyncio.to_thread(
        train_sft,
        service,
        SFT_ADAPTER,
        sft_conversations(),
        steps=steps,
        batch_size=7,
        renderer=renderer,
        adam=AdamParams(learning_rate=1e-2),
        lora=lora,
        save_every=5,
        progress=progress,
    )
    # Everything trains at once: start all runs, then collect their results.
    game_task, sft_task = asyncio.ensure_future(game), asyncio.ensure_future(sft)
    rl_results = await asyncio.gather(*rl_jobs)
    game_results, sft_results = await game_task, await sft_task
    results: dict[str, list[Any]] = dict(zip(RL_TASKS, rl_results, strict=True))
    results.update({GAME[role]: list(records) for role, records in game_results.items()})
    results[SFT_ADAPTER] = list(sft_results)
    return results


def run_demo(workdir: Path, out_dir: Path = Path("demo_out"), steps: int = 20) -> None:
    from opentinker.client import RegistryClient, Renderer, ServiceClient
    from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model

    started = time.perf_counter()
    for directory in (workdir, out_dir):
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
    model_dir = workdir / "tiny-qwen2"
    with console.status("writing a tiny qwen2 model (random weights, BPE tokenizer, chat template)"):
        make_tiny_model(model_dir, TinyModelSpec(arch="qwen2", seed=0))
    processes: list[ServerProcess] = []
    try:
        with console.status("starting registry (embedded Redis), trainer and sampler"):
            registry_proc = start_registry(workdir / "registry")
            processes.append(registry_proc)
            trainer_proc = start_trainer(workdir / "trainer", model_dir, registry_proc)
            processes.append(trainer_proc)
            # --follow '*': hot-reload every version of every adapter as soon as the registry announces it.
            sampler_proc = start_sampler(workdir / "sampler", model_dir, registry_proc, "--follow", "*")
            processes.append(sampler_proc)
        console.print(
            f"registry {registry_proc.address}   trainer {trainer_proc.address}   sampler {sampler_proc.address}"
        )
        service = ServiceClient(
            trainer=trainer_proc.address, sampler=sampler_proc.address, registry=registry_proc.address
        )
        registry = RegistryClient(registry_proc.address)
        renderer = Renderer.from_pretrained(model_dir)

        with Progress(console=console, transient=False) as progress:
            results = asyncio.run(train_everything(service, renderer, steps, progress))

        # metrics.jsonl and the curves
        curves: dict[str, tuple[str, list[float]]] = {}
        with (out_dir / "metrics.jsonl").open("w") as handle:
            for adapter, records in results.items():
                for record in records:
                    handle.write(json.dumps({"adapter": adapter, **record.as_dict()}) + "\n")
                if adapter == SFT_ADAPTER:
                    curves[adapter] = ("loss", [r.loss for r in records])
                else:
                    curves[adapter] = ("reward", [r.mean_reward for r in records])
        plot(curves, out_dir / "curves.png")

        reload_count = scrape(sampler_proc.metrics_address, "opentinker_sampler_reload_seconds_count")
        reload_sum = scrape(sampler_proc.metrics_address, "opentinker_sampler_reload_seconds_sum")
        mean_reload_ms = 1000 * reload_sum / reload_count if reload_count else 0.0
        from opentinker.client.connection import Connection
        from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

        # The reload history is in the sampler's GetStats reply only (the SDK's SamplerStats has no list of it).
        connection = Connection(sampler_proc.address, sampler_pb2_grpc.SamplerServiceStub, timeout=30.0)
        stats = connection.unary("GetStats", sampler_pb2.GetStatsRequest(), sampler_pb2.GetStatsResponse)
        connection.close()
        latencies: dict[str, list[float]] = {}
        for record in stats.recent_reloads:
            if record.ok and record.latency_seconds > 0:
                latencies.setdefault(record.adapter, []).append(record.latency_seconds * 1000)
        table = Table(
            "adapter", "task", "metric", "start", "end", "versions", "reload ms", title="what the adapters learned"
        )
        tasks = {**{a: t for a, (t, _) in RL_TASKS.items()}, SFT_ADAPTER: "SFT on arithmetic chats"}
        tasks.update({adapter: f"echo game ({role})" for role, adapter in GAME.items()})
        for adapter, (kind, values) in curves.items():
            versions = len(registry.list_versions(adapter))
            start, end = mean(values[:3]), mean(values[-3:])
            reload_ms = f"{mean(latencies[adapter]):.1f}" if adapter in latencies else "-"
            table.add_row(adapter, tasks[adapter], kind, f"{start:.3f}", f"{end:.3f}", str(versions), reload_ms)
        console.print(table)
        console.print(
            f"sampler hot reloads: {int(reload_count)}, mean publish -> served latency {mean_reload_ms:.1f} ms "
            "(start/end: means of the first and last 3 steps; reload ms: mean publish -> served per adapter)"
        )

        adapter = "team-a/digits"
        chain = registry.get_lineage(adapter, max_depth=3)
        console.print(f"lineage of {adapter} (newest 3 of {len(registry.list_versions(adapter))} versions):")
        for version in chain:
            traces = [t for b in version.lineage.batches for t in b.trace_ids]
            console.print(
                f"  v{version.number}: parent v{version.lineage.parent_version}, step "
                f"{version.lineage.trainer_step}, {len(traces)} rollouts, e.g. {traces[:2]}"
            )

        sampler = service.create_sampling_client(adapter)
        prompt = renderer.prompt_tokens([{"role": "user", "content": "Give me a number."}])
        from opentinker.client.tasks import TINY_MODEL_SAMPLING

        before = sampler.sample(prompt, TINY_MODEL_SAMPLING).sequences[0]
        move = registry.rollback(adapter, to_version=1)
        sampler_version = 0
        deadline = time.monotonic() + 20
        while sampler_version != 1 and time.monotonic() < deadline:  # the sampler follows the registry's event
            time.sleep(0.1)
            sampler_version = sampler.sample(prompt, TINY_MODEL_SAMPLING).sequences[0].version.version
        after = sampler.sample(prompt, TINY_MODEL_SAMPLING).sequences[0]
        console.print(
            f"rollback {adapter}@latest v{move.previous_version} -> v{move.version}: the sampler served "
            f"v{before.version.version} {before.text!r}, now v{after.version.version} {after.text!r}"
        )
        service.close()
        registry.close()
    finally:
        for process in reversed(processes):
            code = process.terminate()
            console.print(f"stopped {process.ready_file.parent.name} (exit {code})")
    console.print(f"wrote {out_dir / 'curves.png'} and {out_dir / 'metrics.jsonl'}")
    console.print(f"[bold green]demo finished in {time.perf_counter() - started:.0f} s[/]")
