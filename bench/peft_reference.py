"""The reference side of bench/sampler_multilora.py: transformers + peft generating with the same adapters as our
slots (written out in peft's format), and how far its greedy tokens agree with ours."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from workload import Weights, peft_files


def write_peft_adapter(directory: Path, weights: Weights, model_dir: Path) -> Path:
    """The adapter as peft saves it (workload.peft_files), its config naming `model_dir` as the base model."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in peft_files(weights).items():
        (directory / name).write_bytes(data)
    config_file = directory / "adapter_config.json"
    config = {**json.loads(config_file.read_text()), "base_model_name_or_path": str(model_dir)}
    config_file.write_text(json.dumps(config, indent=2))
    return directory


class PeftSampler:
    """transformers + peft with every adapter loaded (names a0, a1, ...)."""

    def __init__(self, model_dir: Path, adapter_dirs: list[Path]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        base.generation_config.eos_token_id = None  # always the full max_new_tokens, like the engine here
        self.pad = int(base.generation_config.pad_token_id)
        self.model: Any = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name="a0")
        for i, directory in enumerate(adapter_dirs[1:], start=1):
            self.model.load_adapter(str(directory), adapter_name=f"a{i}")
        self.model.eval()
        self.names = [f"a{i}" for i in range(len(adapter_dirs))]

    def lora_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if "lora_" in n)

    def mixed(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """One left-padded batch; request i uses adapter i."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                adapter_names=self.names[: len(prompts)],
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
            )
        return [row[width:].tolist() for row in out]

    def sequential(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """One adapter at a time: set_adapter, then a batch-1 generate."""
        outputs: list[list[int]] = []
        for name, prompt in zip(self.names, prompts, strict=False):
            self.model.set_adapter(name)
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new,
                    min_new_tokens=max_new,
                    do_sample=False,
                )
            outputs.append(out[0, len(prompt) :].tolist())
        return outputs


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, float]:
    """(requests with identical tokens, mean fraction of tokens before the first difference)."""
    same, prefix = 0, 0.0
    for a, b in zip(ours, theirs, strict=True):
        same += a == b
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix += first / len(a)
    return same, prefix / len(ours)
