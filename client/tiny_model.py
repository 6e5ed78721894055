"""Build a tiny, random-initialised causal LM plus a matching BPE tokenizer, fully offline.

Tests and local demos need a real Hugging Face model directory (config, safetensors weights, tokenizer,
chat template) without network access to a model hub. `make_tiny_model` trains a byte-level BPE tokenizer
on a small built-in corpus and saves a few-hundred-KB Qwen2 or Llama model next to it. Output is
deterministic: the same `TinyModelSpec` always yields byte-identical files, so `model_files_digest` can
identify a base model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_START_TOKEN",
    "PAD_TOKEN",
    "Arch",
    "TinyModelSpec",
    "build_tokenizer",
    "make_family_model",
    "make_tiny_model",
    "model_files_digest",
]

Arch = Literal["qwen2", "llama"]

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)

# Qwen2's pre-tokenizer split (digits are single tokens). transformers' AutoTokenizer ignores
# tokenizer_class for model_type "qwen2" and rebuilds the pipeline as Qwen2Tokenizer (NFC + this regex +
# ByteLevel without regex); training with the identical pipeline keeps what we train == what loads.
QWEN2_PRETOKENIZE_REGEX: str = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML as used by Qwen. Written without literal newlines between Jinja tags so no whitespace control is
# needed. The `{% generation %}` block marks assistant content *and* its closing <|im_end|> so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` yields a loss mask that teaches the
# model to stop. Tools as Qwen2.5 renders them (a conversation without tools, tool calls and tool messages
# renders as plain ChatML): `tools` -> a system block with their JSON schemas inside <tools></tools> (after the
# first system message's content, which it replaces); an assistant message's `tool_calls` -> <tool_call> JSON
# blocks inside the generation markers (`arguments` as given when it is JSON text already, else as JSON);
# consecutive `tool` messages -> one user turn of <tool_response> blocks. Unlike Qwen2.5 there is no default
# system prompt and the assistant header is always the generation prompt, so a rendered tool call extends it.
_TOOLS_INTRO: str = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_OUTRO: str = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)
CHAT_TEMPLATE: str = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '" + _TOOLS_INTRO + "' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + _TOOLS_OUTRO + "' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}"
    "{% if message['tool_calls'] %}"
    "{% if message['content'] %}{{ message['content'] + '\\n' }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_BASE_CORPUS: str = """\
Hello! How can I help you today?
Hi there. I would like to know the weather in Paris tomorrow.
Sure, here is a short answer: it will be sunny with a high of 21 degrees.
You are a helpful assistant. Answer the question step by step.
The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.
What is the capital of France? The capital of France is Paris.
What is the capital of Japan? The capital of Japan is Tokyo.
Please write a haiku about the ocean. Waves fold into foam; salt wind carries gull cries; tides keep time.
Thank you very much, that was really helpful. You're welcome, have a great day!
Can you explain what a neural network is? A neural network is a function made of layers of weights.
Training uses gradient descent: we compute the loss, take its gradient, and update the parameters.
I don't know the answer to that, but I can try to find out.
Let's think about this carefully. First, we read the problem. Then, we solve it. Finally, we check.
Q: If I have 3 apples and eat 1, how many are left? A: 2 apples are left.
Q: A train travels 60 km in 1 hour. How far does it go in 3 hours? A: 180 km.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 42 100 256 1000 2024 65536.
Punctuation and symbols: ( ) [ ] { } < > = + - * / % ^ & | ~ ! ? , . ; : ' " ` @ # $ _ \\
Email me at user@example.com or visit https://example.org/docs/index.html for details.
Dates like 2024-01-15 and times like 12:30:45 appear in logs.
Unicode: café, naïve, über, señor, 東京, Москва, Ελληνικά, 🙂 👍 🚀.

def add(a: int, b: int) -> int:
    return a + b


def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    out = [0, 1]
    while len(out) < n:
        out.append(out[-1] + out[-2])
    return out[:n]


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def increment(self, step: int = 1) -> None:
        self.count += step


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

import json
data = {"name": "tiny", "layers": 2, "ok": True, "items": [1, 2, 3]}
print(json.dumps(data, indent=2))

if __name__ == "__main__":
    result = add(2, 3)
    assert result == 5, "math is broken"
"""


def _generated_lines() -> list[str]:
    # Deterministic arithmetic so digits, '+', '-', '*' and '=' get useful merges; no RNG involved.
    lines: list[str] = []
    for a in range(0, 40, 3):
        for b in range(1, 30, 4):
            lines.append(f"{a}+{b}={a + b}")
            lines.append(f"{a * 7 + b}-{b}={a * 7}")
            lines.append(f"{a}*{b}={a * b}")
    for n in range(1, 25):
        lines.append(f"User: What is {n} plus {n * 2}? Assistant: {n} plus {n * 2} is {n * 3}.")
        lines.append(f"x_{n} = compute(x_{n - 1}, step={n})  # update {n}")
    return lines


TRAINING_CORPUS: str = _BASE_CORPUS + "\n".join(_generated_lines()) + "\n"


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    arch: Arch = "qwen2"
    vocab_size: int = 512  # total incl. special tokens; the tokenizer is trained/padded to exactly this
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention
    max_position_embeddings: int = 2048
    seed: int = 0


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with exactly `vocab_size` entries (incl. special tokens)."""
    alphabet: list[str] = pre_tokenizers.ByteLevel.alphabet()
    min_size: int = len(alphabet) + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (256 bytes + special tokens), got {vocab_size}")

    tok = Tokenizer(models.BPE())
    # Same pipeline for both archs (see QWEN2_PRETOKENIZE_REGEX). decode(encode(s)) == NFC(s) exactly;
    # add_prefix_space=False so no space is invented at the start.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,  # every byte is encodable, even ones absent from the corpus
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_CORPUS.splitlines(keepends=True), trainer=trainer)

    # A small corpus runs out of merges before large vocab sizes; fill up with reserved special tokens
    # so that len(tokenizer) == config.vocab_size always holds.
    shortfall: int = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if shortfall > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(shortfall)])

    hf_tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,  # otherwise decode() rewrites " ." etc. and breaks round trips
        model_max_length=1 << 30,
        padding_side="right",
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    if len(hf_tok) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(hf_tok)} tokens, expected {vocab_size}")
    return hf_tok


def _build_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,  # None: ChatML models have no BOS
        "dtype": "float32",
    }
    if spec.arch == "qwen2":
        return Qwen2Config(**common)
    if spec.arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown arch {spec.arch!r}")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_tiny_model(out_dir: Path, spec: TinyModelSpec) -> Path:
    """Write a deterministic tiny causal LM + tokenizer to `out_dir` and return `out_dir`.

    Loads with `AutoModelForCausalLM.from_pretrained(out_dir)` / `AutoTokenizer.from_pretrained(out_dir)`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(spec.vocab_size)
    config = _build_config(spec, tokenizer)

    # fork_rng keeps the caller's global RNG state untouched while seeding weight init.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.eval()

    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        do_sample=False,
        max_new_tokens=64,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # All written files are already byte-stable (no timestamps; JSON dicts keep insertion order; safetensors
    # metadata is just {"format": "pt"}), which the determinism test checks via model_files_digest.
    return out_dir


def make_family_model(out_dir: Path, family: str, *, seed: int = 0, vocab_size: int = 512) -> Path:
    """A scaled-down copy of a public checkpoint (`model_families.FAMILIES`): its config.json and
    generation_config.json with every published key, in the hub's format (rope_theta + rope_scaling), random
    weights with norm weights and biases moved away from their 1 / 0 initialisation (so a forward that skipped
    one would differ), and the tiny tokenizer. Deterministic, like make_tiny_model."""
    from transformers import AutoConfig

    from opentinker.client.model_families import scaled_files

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    specials = [int(tokenizer.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS]  # type: ignore[arg-type]
    specials += [vocab_size - 1 - i for i in range(4)]  # more ids than the tokenizer has specials (Llama 3: 4)
    config_json, generation_json = scaled_files(family, vocab_size=vocab_size, special_ids=specials)
    settings = {k: v for k, v in config_json.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = AutoConfig.for_model(config_json["model_type"], **settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith(".bias"):
                    parameter.add_(0.1 * torch.randn_like(parameter))
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # transformers saves its own format (rope_parameters); users' checkpoints come in the hub's, as published.
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_json, indent=2) + "\n")
    return out_dir


def model_files_digest(model_dir: Path) -> str:
    """sha256 over sorted (relative POSIX path, file sha256) of every file under `model_dir`."""
    root = Path(model_dir)
    files: dict[str, Path] = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file()}
    h = hashlib.sha256()
    for rel, path in sorted(files.items()):
        h.update(rel.encode("utf-8"))
        h.update(b"\0")
        h.update(_sha256_file(path).encode("ascii"))
        h.update(b"\n")
    return h.hexdigest()
