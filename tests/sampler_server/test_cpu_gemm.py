"""oneDNN-packed base weights (`--cpu-gemm onednn`, the default): the same logits as the dense weights, the same
shapes for the slot pool, and a server on them serves the same greedy tokens as one on dense weights
(`--cpu-gemm torch`)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from samplerutil import Sampler, greedy, max_diff, prompt, score
from serverproc import ServerProcess, start_sampler

from opentinker.sampler_server.model.batch import ForwardBatch
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.linear import onednn_packing_works, packed_rows
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.v1 import sampler_pb2_grpc

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not onednn_packing_works(), reason="this torch build has no oneDNN packed linear")


def logits(runner: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    cache = KVCache(runner.config, 1, 64, CPU, torch.float32)
    n = len(tokens)
    batch = ForwardBatch(
        tokens=torch.tensor(tokens),
        positions=torch.arange(n),
        block_tables=[[0]],
        new_lens=[n],
        context_lens=[n],
        logits_indices=torch.arange(n),
    )
    return runner.forward(batch, cache)


def test_packed_weights_give_the_dense_logits(tiny_model: Path) -> None:
    dense = LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)
    packed = LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)
    assert packed.pack_for_cpu()
    assert packed.layers[0].q_proj.weight.is_mkldnn and packed.lm_head.is_mkldnn and not packed.embed.is_mkldnn
    assert packed.linear_shapes() == dense.linear_shapes()
    tokens = [(7 * i + 3) % dense.config.vocab_size for i in range(37)]  # 37 rows: padded to 40 and cut back
    expected, got = logits(dense, tokens), logits(packed, tokens)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (got - expected).abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_packed_row_counts_are_few_and_pad_little() -> None:
    sizes = [packed_rows(n) for n in range(1, 4097)]
    assert all(n <= rows <= max(n + 7, n * 1.25) for n, rows in enumerate(sizes, start=1))
    assert sizes == sorted(sizes) and len(set(sizes)) <= 40, len(set(sizes))


def test_packing_is_refused_off_float32(tiny_model: Path) -> None:
    runner = LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.bfloat16)
    assert runner.pack_for_cpu() is False and not runner.layers[0].q_proj.weight.is_mkldnn


def test_the_default_packed_sampler_samples_and_scores_like_one_on_dense_weights(
    tiny_model: Path, registry_server: ServerProcess, sampler_server: ServerProcess, sampler: Sampler, tmp_path: Path
) -> None:
    assert "base matmuls: oneDNN packed weights" in sampler_server.log()  # the session's sampler: default flags
    server = start_sampler(tmp_path, tiny_model, registry_server, "--max-slots", "2", "--cpu-gemm", "torch")
    try:
        assert "base matmuls: torch dense weights" in server.log()
        with grpc.insecure_channel(server.address) as channel:
            dense = sampler_pb2_grpc.SamplerServiceStub(channel)
            for seed in range(3):
                assert greedy(dense, "base", prompt(seed)) == greedy(sampler, "base", prompt(seed))
            tokens = prompt(7, length=24)
            assert max_diff(score(dense, "base", tokens)[0], score(sampler, "base", tokens)[0]) < 1e-4
    finally:
        assert server.terminate() == 0, server.log()
