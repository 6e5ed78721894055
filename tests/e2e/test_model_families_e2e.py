"""The support matrix, through real servers: for each scaled copy of a public checkpoint (`make-tiny-model
--like`), a trainer and a sampler process started with the checkpoint's hub id (in a local HF cache layout,
offline) agree with transformers (and peft, for a trained adapter) to 3e-5 in fp32 over 320 positions, past the
checkpoint's pretrained context length; greedy decoding equals transformers' token for token."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hubcache import REVISION, write_hub_cache
from serverproc import ServerProcess, start_sampler, start_trainer

from opentinker.client import AdamParams, Datum, LoraConfig, ModelInput, SamplingParams, ServiceClient
from opentinker.client.model_families import FAMILIES
from opentinker.client.tiny_model import make_family_model
from opentinker.weights.base_model import model_digest
from opentinker.weights.model_config import load_config

LENGTH = 320
# fp32 logprobs near -6 over 320 positions: the sampler's paged attention sums in another order than transformers'
# SDPA (1.4e-5 seen once on qwen3-8b); a wrong rope or missing norm differs by > 1e-3 (the checks below).
TOL = 3e-5


def _tokens(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=generator).tolist()


def _hf(model_dir: Path, adapter: Path | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def _hf_logprobs(model: Any, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].double()
    values: list[float] = logits[:-1].log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()
    return values


def _hf_greedy(model: Any, prompt: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens: list[int] = []
        for _ in range(count):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens


def _max_diff(a: list[float] | tuple[float, ...], b: list[float] | tuple[float, ...]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _datum(tokens: list[int]) -> Datum:
    return Datum(
        ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-models")
    return {family: make_family_model(root / family, family, seed=5) for family in FAMILIES}


@pytest.fixture(scope="module")
def hub_cache(family_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every family copy in one local Hugging Face cache under its checkpoint's hub id (a revision of its own:
    qwen2.5 and qwen2.5-yarn share one id), as users' servers find them; HF_HOME is inherited by the servers."""
    hf_home = tmp_path_factory.mktemp("hf-home")
    for family, model in family_models.items():
        write_hub_cache(model, hf_home, FAMILIES[family][0], revision=_revision(family))
    saved = {key: os.environ.get(key) for key in ("HF_HOME", "HF_HUB_OFFLINE")}
    os.environ.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    yield hf_home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _revision(family: str) -> str:
    return hashlib.sha1(family.encode()).hexdigest()


@pytest.fixture(scope="module", params=list(FAMILIES))
def stack(
    request: pytest.FixtureRequest,
    family_models: dict[str, Path],
    hub_cache: Path,
    registry_server: ServerProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path, ServiceClient]]:
    """A trainer and a sampler on one family, both started with the checkpoint's hub id (found in the local
    cache only) pinned to its revision; the tests compare with transformers on the copy's own directory."""
    family: str = request.param
    model = family_models[family]
    hub_id = Path(FAMILIES[family][0])
    pin = ("--revision", _revision(family))
    workdir = tmp_path_factory.mktemp(f"family-{family}")
    trainer = start_trainer(workdir / "trainer", hub_id, registry_server, *pin)
    try:
        # --max-len: room for the 320 probe positions (the default caps the context at 4096 or the model's).
        sampler = start_sampler(workdir / "sampler", hub_id, registry_server, *pin, "--max-len", str(LENGTH + 64))
        try:
            with ServiceClient(trainer.address, sampler.address, registry_server.address) as service:
                info = service.get_trainer_info()
                assert (info.model, info.model_digest) == (str(hub_id), model_digest(model))
                yield family, model, service
        finally:
            sampler.terminate()
    finally:
        trainer.terminate()


def test_trainer_sampler_and_transformers_agree(stack: tuple[str, Path, ServiceClient], tmp_path: Path) -> None:
    family, model_dir, service = stack
    tokens = _tokens(LENGTH, seed=len(family))
    hf = _hf(model_dir)
    expected = _hf_logprobs(hf, tokens)
    adapter = f"families/{family.replace('.', '-')}"
    training = service.create_training_client(adapter, LoraConfig(rank=4, alpha=8.0), seed=2)
    # A fresh adapter's B is zero: its logprobs are the base model's.
    trained_before = training.forward([_datum(tokens)]).logprobs[0]
    assert _max_diff(trained_before, expected) <= TOL, f"{family}: trainer vs transformers"
    base = service.create_sampling_client("base")
    assert _max_diff(base.compute_logprobs(tokens), expected) <= TOL, f"{family}: sampler vs transformers"
    prompt_logprobs = base.sample(tokens, SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=True)
    assert prompt_logprobs.prompt_logprobs is not None
    assert _max_diff(prompt_logprobs.prompt_logprobs, expected) <= TOL

    # Greedy, 32 tokens, as transformers decodes them (up to an eos the sampler stops at).
    prompt = tokens[:40]
    (sequence,) = base.sample(prompt, SamplingParams(max_tokens=32, temperature=0.0)).sequences
    want = _hf_greedy(hf, prompt, 32)
    eos = set(load_config(model_dir).eos_token_ids)
    if sequence.stop_reason == "stop_token":
        assert sequence.tokens[-1] in eos
    else:
        assert sequence.stop_reason == "length" and not eos & set(want)
    assert list(sequence.tokens) == want[: len(sequence.tokens)]

    # A trained adapter: peft on transformers' model gives the trainer's and the sampler's logprobs.
    for step in range(2):
        training.forward_backward([_datum(_tokens(48, seed=100 + step))])
        training.optim_step(AdamParams(learning_rate=2e-2))
    version = training.save_snapshot()
    trained = training.forward([_datum(tokens)]).logprobs[0]
    assert _max_diff(trained, trained_before) > 1e-3  # the steps changed the weights
    folder = tmp_path / "peft"
    service.registry_client().download_artifact(version.artifact_uri, folder)
    peft_logprobs = _hf_logprobs(_hf(model_dir, folder), tokens)
    assert _max_diff(trained, peft_logprobs) <= TOL, f"{family}: trainer vs peft"
    served = service.create_sampling_client(version.reference).compute_logprobs(tokens)
    assert _max_diff(served, peft_logprobs) <= TOL, f"{family}: sampler vs peft"


def test_a_hub_id_pinned_to_a_revision_serves_that_snapshots_numbers(
    family_models: dict[str, Path], registry_server: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two snapshots of one hub id in the cache, main on the newer: --revision serves the older, in both
    servers, with the older files' fingerprint."""
    hub_id = "meta-llama/Llama-3.2-1B-Instruct"
    pinned = family_models["llama3.2"]
    newer = make_family_model(tmp_path / "newer", "llama3.2", seed=9)
    hf_home = tmp_path / "hf-home"
    write_hub_cache(pinned, hf_home, hub_id, revision=REVISION)
    write_hub_cache(newer, hf_home, hub_id, revision="f" * 40)  # refs/main now names this one
    monkeypatch.setenv("HF_HOME", str(hf_home))  # inherited by the server processes
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no ./meta-llama folder: only the cache has the model
    tokens = _tokens(LENGTH, seed=77)
    expected = _hf_logprobs(_hf(pinned), tokens)
    assert _max_diff(_hf_logprobs(_hf(newer), tokens), expected) > 1e-3  # the snapshots differ
    pin = ("--revision", REVISION)
    trainer = start_trainer(tmp_path / "trainer", Path(hub_id), registry_server, *pin)
    try:
        sampler = start_sampler(tmp_path / "sampler", Path(hub_id), registry_server, *pin, "--max-len", "384")
        try:
            with ServiceClient(trainer.address, sampler.address, registry_server.address) as service:
                info = service.get_trainer_info()
                assert (info.model, info.model_digest) == (hub_id, model_digest(pinned))
                training = service.create_training_client("families/hub-llama", LoraConfig(rank=4), seed=1)
                assert _max_diff(training.forward([_datum(tokens)]).logprobs[0], expected) <= TOL
                sampled = service.create_sampling_client("base").compute_logprobs(tokens)
                assert _max_diff(sampled, expected) <= TOL
        finally:
            sampler.terminate()
    finally:
        trainer.terminate()


def test_bfloat16_on_the_cpu_serves_and_trains_within_the_measured_drift(
    family_models: dict[str, Path], registry_server: ServerProcess, tmp_path: Path
) -> None:
    """`--dtype bfloat16` in both servers on the CPU: the sampler's logprobs stay within bf16 rounding of the
    trainer's (docs/models.md: bench/bf16_drift.py) and both differ from float32 (bf16 is really used)."""
    model_dir = family_models["qwen3"]
    tokens = _tokens(LENGTH, seed=5)
    fp32 = _hf_logprobs(_hf(model_dir), tokens)
    bf16 = ("--dtype", "bfloat16")
    trainer = start_trainer(tmp_path / "trainer", model_dir, registry_server, *bf16)
    try:
        sampler = start_sampler(tmp_path / "sampler", model_dir, registry_server, *bf16, "--max-len", "384")
        try:
            with ServiceClient(trainer.address, sampler.address, registry_server.address) as service:
                training = service.create_training_client("families/bf16", LoraConfig(rank=4), seed=1)
                trained = training.forward([_datum(tokens)]).logprobs[0]
                base = service.create_sampling_client("base")
                sampled = base.compute_logprobs(tokens)
                (sequence,) = base.sample(tokens[:40], SamplingParams(max_tokens=16, temperature=0.0)).sequences
        finally:
            sampler.terminate()
    finally:
        trainer.terminate()
    assert _max_diff(sampled, trained) <= 0.02
    assert sum(abs(a - b) for a, b in zip(sampled, trained, strict=True)) / len(trained) <= 1e-3
    assert sum(abs(a - b) for a, b in zip(trained, fp32, strict=True)) / len(fp32) > 1e-5
    assert sequence.tokens and sequence.stop_reason in ("length", "stop_token")


# Families outside the supported list, as their configs name them (scaled; no weight files at all).
UNSUPPORTED = {
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "intermediate_size": 128,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "intermediate_size": 128,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "num_experts": 8,
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "n_routed_experts": 8,
    },
}


@pytest.mark.parametrize("family", list(UNSUPPORTED))
def test_an_unsupported_family_is_refused_by_every_server_in_one_line(family: str, tmp_path: Path) -> None:
    import json
    import subprocess

    from serverproc import opentinker_command

    model = tmp_path / family
    model.mkdir()
    (model / "config.json").write_text(json.dumps(UNSUPPORTED[family]))
    for server in ("trainer", "sampler"):
        args = opentinker_command(
            server,
            "serve",
            "--model",
            str(model),
            "--registry",
            "127.0.0.1:1",
            "--store",
            str(tmp_path / "store"),
            "--port",
            "0",
            "--device",
            "cpu",
        )
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (server, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert lines[0].startswith(f"opentinker {server}: --model {model}: model_type '{family}'"), lines
        assert "supported: llama, mistral, qwen2, qwen3" in lines[0]
    # registry import checks an adapter against its base model the same way.
    from safetensors.torch import save_file

    peft = tmp_path / "adapter"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(64, 4)},
        str(peft / "adapter_model.safetensors"),
    )
    done = subprocess.run(
        opentinker_command(
            "registry", "import", str(peft), "team/x", "--base-model", str(model), "--registry", "127.0.0.1:1"
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"model_type '{family}' is not a supported family" in done.stderr, done.stderr
