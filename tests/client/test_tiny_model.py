"""Tests for opentinker.client.tiny_model: offline tiny base models that load through HF Auto classes."""

from __future__ import annotations

import json
import random
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM

from opentinker.client.tiny_model import Arch, TinyModelSpec, make_tiny_model, model_files_digest

ARCHS: tuple[Arch, ...] = ("qwen2", "llama")
MODEL_CLASSES: dict[str, type[Any]] = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}

MESSAGES: list[dict[str, str]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12+7?"},
    {"role": "assistant", "content": "12+7=19"},
]
EXPECTED_CHATML: str = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWhat is 12+7?<|im_end|>\n"
    "<|im_start|>assistant\n12+7=19<|im_end|>\n"
)


@dataclass(frozen=True)
class Built:
    spec: TinyModelSpec
    dir_a: Path  # seed 0
    dir_b: Path  # seed 0 again, separate directory
    dir_other_seed: Path  # seed 1


@pytest.fixture(scope="module", autouse=True)
def _hf_offline() -> Iterator[None]:
    # Module-scoped fixtures cannot use the function-scoped `monkeypatch`; use a context instead.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module", params=ARCHS)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _hf_offline: None) -> Built:
    arch: Arch = request.param
    spec = TinyModelSpec(arch=arch, seed=0)
    root = tmp_path_factory.mktemp(f"tiny-{arch}")
    return Built(
        spec=spec,
        dir_a=make_tiny_model(root / "a", spec),
        dir_b=make_tiny_model(root / "b", spec),
        dir_other_seed=make_tiny_model(root / "seed1", replace(spec, seed=1)),
    )


def test_loads_with_auto_classes(built: Built) -> None:
    spec = built.spec
    tok: Any = AutoTokenizer.from_pretrained(built.dir_a)
    model: Any = AutoModelForCausalLM.from_pretrained(built.dir_a)

    assert type(model) is MODEL_CLASSES[spec.arch]
    cfg = model.config
    assert cfg.model_type == spec.arch
    assert cfg.num_attention_heads == spec.num_attention_heads
    assert cfg.num_key_value_heads == spec.num_key_value_heads
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # really GQA
    assert cfg.hidden_size == spec.hidden_size
    assert cfg.num_hidden_layers == spec.num_hidden_layers
    assert cfg.tie_word_embeddings is False
    assert model.dtype == torch.float32

    assert len(tok) == spec.vocab_size == cfg.vocab_size
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    assert cfg.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    # GQA: k/v projections are narrower than q.
    attn = model.model.layers[0].self_attn
    head_dim = spec.hidden_size // spec.num_attention_heads
    assert attn.q_proj.out_features == spec.num_attention_heads * head_dim
    assert attn.k_proj.out_features == spec.num_key_value_heads * head_dim


def _round_trip_samples() -> list[str]:
    samples = [
        "",
        "Hello, world!",
        "line one\nline two\r\n\ttabbed  double  spaces   \n\n",
        "emoji 🙂👍🏽🚀 and flags 🇫🇷 and ZWJ 👩‍💻",
        "東京 Москва Ελληνικά café naïve العربية हिन्दी",
        "def f(x):\n    return x ** 2  # comment\n",
        "control \x00\x01\x7f bytes and <|im_end|> literal",
        " leading space and trailing space ",
    ]
    # Deterministic pseudo-random strings drawn from assigned code point ranges.
    ranges = [
        (0x20, 0x7E),
        (0xA0, 0x17F),
        (0x370, 0x3FF),
        (0x400, 0x4FF),
        (0x4E00, 0x4FFF),
        (0x1F300, 0x1F64F),
    ]
    rng = random.Random(1234)
    for _ in range(20):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        chars.insert(rng.randint(0, len(chars)), rng.choice(["\n", " ", "\t", "  "]))
        samples.append("".join(chars))
    return samples


def test_tokenizer_round_trips_unicode(built: Built) -> None:
    tok: Any = AutoTokenizer.from_pretrained(built.dir_a)
    raw = Tokenizer.from_file(str(built.dir_a / "tokenizer.json"))
    for text in _round_trip_samples():
        ids: list[int] = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, repr(text)
        # What AutoTokenizer loads (Qwen2Tokenizer for qwen2) must equal the trained tokenizer.json.
        assert raw.encode(text, add_special_tokens=False).ids == ids, repr(text)
    # The normaliser is NFC (as Qwen's), so decomposed input decodes to its composed form.
    decomposed = "cafe\u0301"
    assert tok.decode(tok.encode(decomposed, add_special_tokens=False)) == unicodedata.normalize("NFC", decomposed)
    # Every single byte value is encodable (ByteLevel initial alphabet) and no id is out of range.
    all_bytes = bytes(range(256)).decode("latin-1")
    ids = tok.encode(all_bytes, add_special_tokens=False)
    assert tok.decode(ids) == all_bytes
    assert max(ids) < len(tok)


def test_chat_template(built: Built) -> None:
    tok: Any = AutoTokenizer.from_pretrained(built.dir_a)
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == EXPECTED_CHATML
    prompt = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12+7?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    # {% generation %} markers: the mask covers assistant content plus its <|im_end|> (so the model learns
    # to stop), and nothing else.
    out = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids: list[int] = list(out["input_ids"])
    mask: list[int] = list(out["assistant_masks"])
    assert len(ids) == len(mask)
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "12+7=19<|im_end|>"
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_determinism(built: Built) -> None:
    files_a = sorted(p.name for p in built.dir_a.iterdir())
    assert files_a == sorted(p.name for p in built.dir_b.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files_a)
    assert model_files_digest(built.dir_a) == model_files_digest(built.dir_b)

    other = built.dir_other_seed
    assert model_files_digest(built.dir_a) != model_files_digest(other)
    # Seed only affects weights: tokenizer and config are identical, every weight matrix differs.
    for name in ("tokenizer.json", "config.json"):
        assert (built.dir_a / name).read_bytes() == (other / name).read_bytes()
    w_a = load_file(built.dir_a / "model.safetensors")
    w_o = load_file(other / "model.safetensors")
    assert w_a.keys() == w_o.keys()
    matrices = [k for k, v in w_a.items() if v.ndim == 2]
    assert matrices
    assert all(not torch.equal(w_a[k], w_o[k]) for k in matrices)


def test_logits_finite(built: Built) -> None:
    tok: Any = AutoTokenizer.from_pretrained(built.dir_a)
    model: Any = AutoModelForCausalLM.from_pretrained(built.dir_a)
    model.eval()
    input_ids = torch.tensor([tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], built.spec.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std().item() > 1e-3  # not degenerate


def test_global_rng_untouched_and_vocab_padding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    # The built-in corpus yields < 2048 BPE tokens, so reserved special tokens pad the vocab up.
    spec = TinyModelSpec(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1, seed=5)
    out = make_tiny_model(tmp_path / "m", spec)
    assert torch.equal(before, torch.random.get_rng_state())

    tok: Any = AutoTokenizer.from_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert len(tok) == config["vocab_size"] == 2048
    assert "<|reserved_0|>" in tok.get_vocab()


def test_vocab_too_small_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_model(tmp_path / "m", TinyModelSpec(vocab_size=100))
