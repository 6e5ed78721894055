"""Thinking Machines' tinker-cookbook (0.6.1, with tinker 0.38.0) as an external test suite: its recipes run
unmodified, in a virtualenv of their own (cookbook_venv.py), against one stack in their own processes (registry,
trainer, sampler, gateway) over a scaled copy of Qwen3 served under the hub id the cookbook knows, found in a local
Hugging Face cache (offline). Each recipe runs 2 steps and must exit 0; the registry must then hold the versions it
saved, with their lineage. Skipped, with the reason, only when the package index cannot be reached."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cookbook_venv import IndexUnreachable, cookbook_python
from hubcache import write_hub_cache
from serverproc import ServerProcess, opentinker_command, start_sampler, start_trainer

from opentinker.client import RegistryClient
from opentinker.client.registry_types import Version
from opentinker.client.tiny_model import make_family_model
from opentinker.weights.base_model import model_digest

MODEL = "Qwen/Qwen3-4B-Instruct-2507"  # the cookbook's model_info knows it: renderer qwen3_instruct
STEPS = 2
CONTEXT = 4096
HERE = Path(__file__).resolve().parent
# One tenant (API key) per recipe: the registry's adapters of a tenant are the recipe's.
RECIPES = ("math-rl", "sl", "rl-sync", "rl-async", "guess-number")
pytestmark = pytest.mark.timeout(1800)  # the first run builds the cookbook's virtualenv


@dataclass(frozen=True, slots=True)
class Stack:
    python: Path
    base_url: str
    hf_home: Path
    registry: RegistryClient
    digest: str


def _key(recipe: str) -> str:
    return f"tml-cookbook-{recipe}"


def _tenant(recipe: str) -> str:
    return f"cb-{recipe}"


@pytest.fixture(scope="module")
def python() -> Path:
    try:
        return cookbook_python()
    except IndexUnreachable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def stack(python: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("cookbook")
    model = make_family_model(root / "qwen3", "qwen3", seed=3)
    # The copy's context is Qwen3's shrunk 64x (640); the tiny tokenizer spends a few times Qwen's tokens on the
    # same text, and guess_number's prompts need ~700. Plain RoPE: any length computes the same way.
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}, indent=2))
    hf_home = root / "hf-home"
    write_hub_cache(model, hf_home, MODEL)
    keys = root / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": _key(r), "tenant": _tenant(r)} for r in RECIPES]}))
    servers: list[ServerProcess] = []
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("HF_HOME", str(hf_home))  # inherited by the servers: they find MODEL in this cache only
            env.setenv("HF_HUB_OFFLINE", "1")
            env.chdir(root)  # no ./Qwen folder: the model is the cache's
            servers.append(start_trainer(root / "trainer", Path(MODEL), registry_server))
            servers.append(start_sampler(root / "sampler", Path(MODEL), registry_server, "--max-slots", "8"))
        trainer, sampler = servers
        servers.append(
            ServerProcess(
                opentinker_command(
                    "gateway",
                    "serve",
                    "--trainer",
                    trainer.address,
                    "--sampler",
                    sampler.address,
                    "--registry",
                    registry_server.address,
                    "--keys-file",
                    str(keys),
                    "--port",
                    "0",
                ),
                root / "gateway",
            )
        )
        with RegistryClient(registry_server.address) as registry:
            yield Stack(python, f"http://{servers[-1].address}", hf_home, registry, model_digest(model))
    finally:
        for server in reversed(servers):
            assert server.terminate() == 0, server.log()


def _run(stack: Stack, recipe: str, args: list[str], workdir: Path) -> None:
    """One recipe as a user runs it: the SDK finds the service and the key in its environment variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TINKER_BASE_URL")}
    env.update(
        TINKER_BASE_URL=stack.base_url,
        TINKER_API_KEY=_key(recipe),
        TINKER_TELEMETRY="0",
        HF_HOME=str(stack.hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
    )
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "recipe.log"
    with log.open("wb") as out:
        code = subprocess.run(
            [str(stack.python), *args],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=900,
            check=False,
        ).returncode
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert code == 0, f"{recipe} exited {code}:\n{tail}"


def _versions(stack: Stack, recipe: str) -> dict[str, list[Version]]:
    adapters = stack.registry.list_adapters(prefix=f"{_tenant(recipe)}/")
    return {a.name: sorted(stack.registry.list_versions(a.name), key=lambda v: v.number) for a in adapters}


def _check_lineage(stack: Stack, recipe: str) -> None:
    """The recipe's saved weights are registry versions of its tenant's adapter, each one's lineage going back
    to the one before, trained on the served base, the last one after all the steps."""
    by_adapter = _versions(stack, recipe)
    assert by_adapter, f"{recipe}: no adapter of tenant {_tenant(recipe)} in the registry"
    trained = [versions for versions in by_adapter.values() if versions and versions[-1].lineage.trainer_step]
    assert len(trained) == 1, f"{recipe}: {by_adapter}"
    versions = trained[0]
    # The SDK's default LoRA (train_unembed=True with attn and mlp) is what the trainer made: lm_head included.
    adapter = stack.registry.get_adapter(versions[0].adapter)
    assert set(adapter.target_modules) == {"attn", "mlp", "lm_head"}, adapter
    assert len(versions) >= STEPS, f"{recipe}: {[v.reference for v in versions]}"
    for earlier, later in itertools.pairwise(versions):
        assert later.lineage.parent_version == earlier.number, (earlier, later)
        assert later.lineage.trainer_step >= earlier.lineage.trainer_step
        assert later.lineage.tokens_trained >= earlier.lineage.tokens_trained
    last = versions[-1].lineage
    assert last.trainer_step == STEPS, versions[-1]
    assert last.tokens_trained > 0 and last.base_model_digest == stack.digest
    assert any(v.lineage.batches for v in versions), "no version records the batches it was trained on"


def _cli(recipe_module: str, log_path: Path, *args: str) -> list[str]:
    return ["-m", recipe_module, f"log_path={log_path}", "behavior_if_log_dir_exists=delete", *args]


def test_math_rl_recipe_cli_as_shipped(stack: Stack, tmp_path: Path) -> None:
    """`python -m tinker_cookbook.recipes.math_rl.train env=arithmetic`, with its default loss."""
    args = _cli(
        "tinker_cookbook.recipes.math_rl.train",
        tmp_path / "log",
        f"model_name={MODEL}",
        "env=arithmetic",
        "group_size=2",
        "groups_per_batch=2",
        "max_tokens=5",
        "lora_rank=8",
        f"max_steps={STEPS}",
        "eval_every=0",
        "save_every=1",
    )
    _run(stack, "math-rl", args, tmp_path)
    _check_lineage(stack, "math-rl")


@pytest.mark.parametrize("mode", ["sl", "rl-sync", "rl-async"])
def test_cookbook_training_main(stack: Stack, tmp_path: Path, mode: str) -> None:
    """supervised.train.main on FromConversationFileBuilder chats; rl.train.main on ArithmeticDatasetBuilder,
    sync and async (cookbook_drivers.py)."""
    _run(stack, mode, [str(HERE / "cookbook_drivers.py"), mode, str(tmp_path / "log")], tmp_path)
    _check_lineage(stack, mode)


def test_multiplayer_guess_number_recipe(stack: Stack, tmp_path: Path) -> None:
    args = _cli(
        "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
        tmp_path / "log",
        f"model_name={MODEL}",
        "renderer_name=qwen3_instruct",
        "group_size=2",
        "batch_size=2",
        "max_tokens=8",
        f"max_steps={STEPS}",
        "eval_every=0",
        "save_every=1",
    )
    _run(stack, "guess-number", args, tmp_path)
    _check_lineage(stack, "guess-number")
