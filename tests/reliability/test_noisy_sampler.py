"""Noisy neighbours on the sampler (issue 22, cases 1, 6 and 14; issue 32, detokenization): two user tenants and an
admin with tokens, one registry and one sampler (engine process, the CPU default), real processes. In each test
team-a does the abuse while team-b runs its normal workload at the same time (seeded samples of its own adapter and
of the base model): team-b gets 0 errors and the outputs of a run without the abuse, team-a gets the precise status,
and the sampler's memory (PSS of its processes) after the abuse is within a stated bound of before."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from faultutil import wait_for
from metricsutil import metric, scrape
from overflowutil import out_of_range_lora_files, overflowing_lora_files
from registryutil import lora_files, upload
from samplerutil import Outputs, collect, params, prompt, request, seeded_samples
from tenantstack import TenantStack, tenant_stack
from trainerutil import assert_status, model_input, rpc_error

from opentinker.cli.launch import tree_memory
from opentinker.v1 import common_pb2, registry_pb2, sampler_pb2

MiB = 2**20
MEMORY_BOUND = 64 * MiB  # the sampler's PSS after an abuse, above its PSS before
# After 10 MiB requests: gRPC's receive buffers and the parsed messages leave the allocator's high-water mark
# (a plateau, measured +60..+200 MiB over 4..40 such requests, not a leak); tokenizing them cost +1.2 GB before.
HUGE_REQUEST_MEMORY_BOUND = 192 * MiB
WORKLOAD_ROUNDS = 2
NON_FINITE = "opentinker_sampler_non_finite_requests_total"


@dataclass
class Noisy(TenantStack):
    model: Path
    baseline: Outputs = field(default_factory=list)  # team-b's workload alone

    def publish(self, who: str, adapter: str, files: dict[str, bytes], *, alpha: float) -> registry_pb2.Version:
        """UploadArtifact + PublishVersion as `who` (moves the adapter's latest alias)."""
        uri = upload(self.registry, files, metadata=self.md(who), timeout=60)
        config = common_pb2.LoraConfig(rank=4, alpha=alpha)
        request_ = registry_pb2.PublishVersionRequest(adapter=adapter, artifact_uri=uri, lora_config=config)
        response: registry_pb2.PublishVersionResponse = self.registry.PublishVersion(
            request_, metadata=self.md(who), timeout=60
        )
        return response.version

    def memory(self) -> int:
        return tree_memory(self.sampler_server.process.pid)


def workload(noisy: Noisy) -> Outputs:
    return seeded_samples(noisy.sampler, noisy.md("team-b"))


def during(noisy: Noisy, abuse: Callable[[], object]) -> tuple[object, list[Outputs], list[BaseException]]:
    """Runs the abuse and WORKLOAD_ROUNDS of team-b's workload at the same time: (abuse result, team-b's outputs,
    team-b's errors)."""
    with concurrent.futures.ThreadPoolExecutor(WORKLOAD_ROUNDS + 1) as pool:
        attack = pool.submit(abuse)
        rounds = [pool.submit(workload, noisy) for _ in range(WORKLOAD_ROUNDS)]
        outputs: list[Outputs] = []
        errors: list[BaseException] = []
        for future in rounds:
            try:
                outputs.append(future.result())
            except Exception as error:  # counted: team-b must see none
                errors.append(error)
        return attack.result(), outputs, errors


@pytest.fixture(scope="module")
def noisy(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Noisy]:
    workdir = tmp_path_factory.mktemp("noisy-sampler")
    with tenant_stack(workdir, tiny_model, "--follow", "team-a/*", "--max-slots", "4") as stack:
        noisy = Noisy(
            stack.registry_server, stack.sampler_server, stack.tokens, stack.registry, stack.sampler, model=tiny_model
        )
        for tenant in ("team-a", "team-b"):
            create = registry_pb2.CreateAdapterRequest(
                name=f"{tenant}/policy", lora_config=common_pb2.LoraConfig(rank=4)
            )
            noisy.registry.CreateAdapter(create, metadata=noisy.md(tenant), timeout=60)
        noisy.publish("team-b", "team-b/policy", lora_files(tiny_model, seed=5), alpha=4.0)
        noisy.baseline = workload(noisy)
        assert noisy.baseline == workload(noisy)  # seeded: the same outputs every run
        yield noisy


def assert_team_b_unharmed(noisy: Noisy, outputs: list[Outputs], errors: list[BaseException]) -> None:
    assert errors == []
    assert len(outputs) == WORKLOAD_ROUNDS and all(run == noisy.baseline for run in outputs)


# --- case 1: an adapter that makes its logits non-finite ----------------------------------------------------


def test_an_exploding_adapter_fails_only_its_own_requests(noisy: Noisy, figure: Callable[[str, object], None]) -> None:
    name = "team-a/exploding"
    create = registry_pb2.CreateAdapterRequest(name=name, lora_config=common_pb2.LoraConfig(rank=4))
    noisy.registry.CreateAdapter(create, metadata=noisy.md("team-a"), timeout=60)
    # Within the load-time magnitude rule (|w| = 1e4, scaling 1024), so it loads; its logits are NaN.
    version = noisy.publish("team-a", name, overflowing_lora_files(noisy.model), alpha=4096.0)
    reference = f"{name}@{version.version}"
    memory_before = noisy.memory()
    counted_before = metric(scrape(noisy.sampler_server.metrics_address), NON_FINITE)

    def abuse() -> list[grpc.RpcError]:
        errors = []
        for i in range(6):  # at temperature 1 (n=3) and greedy, like any client would sample it
            sampling = params(temperature=1.0 if i % 2 else 0.0, max_tokens=16)
            req = request(reference, prompt(30 + i), sampling, num_samples=3 if i % 2 else 1)
            errors.append(
                rpc_error(lambda r=req: list(noisy.sampler.Sample(r, metadata=noisy.md("team-a"), timeout=120)))
            )
        scoring = sampler_pb2.ComputeLogprobsRequest(model=reference, inputs=[model_input(prompt(40))])
        errors.append(
            rpc_error(lambda: noisy.sampler.ComputeLogprobs(scoring, metadata=noisy.md("team-a"), timeout=120))
        )
        return errors

    errors, outputs, team_b_errors = during(noisy, abuse)
    assert isinstance(errors, list) and len(errors) == 7
    for error in errors:
        assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, "NON_FINITE_OUTPUT")
        assert reference in str(error.details())
    assert_team_b_unharmed(noisy, outputs, team_b_errors)
    assert metric(scrape(noisy.sampler_server.metrics_address), NON_FINITE) - counted_before == 6  # the Samples
    stats = noisy.sampler.GetStats(sampler_pb2.GetStatsRequest(), metadata=noisy.md("ops"), timeout=60)
    assert stats.running_requests == 0 and stats.waiting_requests == 0
    listed = noisy.sampler.ListLoaded(sampler_pb2.ListLoadedRequest(), metadata=noisy.md("ops"), timeout=60).adapters
    assert [a.active_requests for a in listed if a.version.adapter == name] == [0]  # every pin ended
    memory_after = noisy.memory()
    figure(
        "noisy case 1 (exploding adapter): team-a errors, team-b errors, sampler PSS before -> after (MiB)",
        f"{len(errors)} FAILED_PRECONDITION NON_FINITE_OUTPUT, {len(team_b_errors)}, "
        f"{memory_before / MiB:.0f} -> {memory_after / MiB:.0f}",
    )
    assert memory_after - memory_before < MEMORY_BOUND, (memory_before / MiB, memory_after / MiB)


def test_a_version_beyond_the_magnitude_rule_is_refused_and_the_alias_keeps_the_previous(noisy: Noisy) -> None:
    name = "team-a/policy"  # followed (--follow team-a/*): each publish moves latest and the sampler reloads
    good = noisy.publish("team-a", name, lora_files(noisy.model, seed=11), alpha=4.0)

    def served() -> int:
        req = request(name, prompt(50), params(max_tokens=1))
        first = next(iter(noisy.sampler.Sample(req, metadata=noisy.md("team-a"), timeout=60)))
        return int(first.version.version)

    assert wait_for(lambda: served() == good.version)

    def abuse() -> registry_pb2.Version:
        bad = noisy.publish("team-a", name, out_of_range_lora_files(noisy.model), alpha=4.0)  # latest -> bad
        load = sampler_pb2.LoadAdapterRequest(reference=f"{name}@{bad.version}")
        error = rpc_error(lambda: noisy.sampler.LoadAdapter(load, metadata=noisy.md("team-a"), timeout=60))
        assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_OUT_OF_RANGE")
        assert f"{name}@{bad.version}" in str(error.details()) and "3e+38" in str(error.details())

        def failure_recorded() -> bool:
            stats = noisy.sampler.GetStats(sampler_pb2.GetStatsRequest(), metadata=noisy.md("team-a"), timeout=60)
            return any(
                r.adapter == name
                and r.to_version == bad.version
                and not r.ok
                and r.error.startswith("FAILED_PRECONDITION")
                for r in stats.recent_reloads
            )

        assert wait_for(failure_recorded)
        return bad

    bad, outputs, team_b_errors = during(noisy, abuse)
    assert isinstance(bad, registry_pb2.Version)
    assert_team_b_unharmed(noisy, outputs, team_b_errors)
    assert served() == good.version  # the registry's latest is the refused version; the sampler kept the good one
    listed = noisy.sampler.ListLoaded(sampler_pb2.ListLoadedRequest(), metadata=noisy.md("team-a"), timeout=60)
    versions = {a.version.version: a for a in listed.adapters if a.version.adapter == name}
    assert bad.version not in versions and "latest" in versions[good.version].serving_aliases


# --- case 6: huge text prompts --------------------------------------------------------------------------------


def test_huge_prompt_text_is_refused_before_tokenizing_and_blocks_no_one(
    noisy: Noisy, figure: Callable[[str, object], None]
) -> None:
    info = noisy.sampler.GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest(), metadata=noisy.md("team-a"), timeout=60)
    limit = 16 * info.base_model.max_position_embeddings  # --max-prompt-bytes' default: 16 bytes per context token
    sentence = "The quick brown fox jumps over the lazy dog. "

    def text(size: int) -> str:
        return (sentence * (size // len(sentence) + 1))[:size]

    def sample_text(prompt_text: str, max_tokens: int = 4) -> list[sampler_pb2.SampleResponse]:
        req = sampler_pb2.SampleRequest(
            model="base", prompt_text=prompt_text, sampling_params=params(max_tokens=max_tokens)
        )
        return list(noisy.sampler.Sample(req, metadata=noisy.md("team-a"), timeout=120))

    sample_text(text(1000))  # warm: the first text prompt starts the tokenizing thread
    memory_before = noisy.memory()

    def abuse() -> tuple[list[grpc.RpcError], list[grpc.RpcError], int]:
        refused = [rpc_error(sample_text, text(10 * 2**20)) for _ in range(4)]  # 10 MiB, as in the issue
        refused += [rpc_error(sample_text, text(limit + 1)), rpc_error(sample_text, "é" * (limit // 2 + 1))]
        tokenized = [rpc_error(sample_text, text(limit)) for _ in range(3)]  # allowed: tokenized, then too many tokens
        allowed = sample_text(text(3000))  # large but within the context: served
        return refused, tokenized, sum(len(m.tokens) for m in allowed)

    result, outputs, team_b_errors = during(noisy, abuse)
    assert isinstance(result, tuple)
    refused, tokenized, generated = result
    for error in refused:
        metadata = assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "PROMPT_TOO_LONG")
        assert metadata.get("field") == "prompt_text" and "--max-prompt-bytes" in str(error.details())
    for error in tokenized:
        metadata = assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "PROMPT_TOO_LONG")
        assert metadata.get("field") == "prompt" and "tokens; the context holds" in str(error.details())
    assert generated == 4
    assert_team_b_unharmed(noisy, outputs, team_b_errors)
    memory_after = noisy.memory()
    figure(
        "noisy case 6 (10 MiB prompt_text): team-a refusals, team-b errors, sampler PSS before -> after (MiB)",
        f"{len(refused)} + {len(tokenized)} PROMPT_TOO_LONG, {len(team_b_errors)}, "
        f"{memory_before / MiB:.0f} -> {memory_after / MiB:.0f}",
    )
    assert memory_after - memory_before < HUGE_REQUEST_MEMORY_BOUND, (memory_before / MiB, memory_after / MiB)


# --- the server's detokenization: every tenant's streams decode on one event loop ---------------------------


def test_streams_full_of_stop_strings_leave_team_b_its_outputs(
    noisy: Noisy, figure: Callable[[str, object], None]
) -> None:
    """team-a's streams keep the server's decoding busy (n=4 samples each, 16 long stop strings that never match,
    tokens at temperature 1, which on the tiny model are often stray bytes held back as incomplete characters);
    team-b's seeded samples come out as they do alone, and team-a's text is its tokens' text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(noisy.model)
    stops = [f"{i}" + "never-generated " * 32 for i in range(16)]

    def stream(i: int) -> list[tuple[list[int], str]]:
        sampling = params(temperature=1.0, seed=500 + i, max_tokens=96, stop_strings=stops)
        result = collect(
            noisy.sampler.Sample(
                request("base", prompt(60 + i), sampling, num_samples=4), metadata=noisy.md("team-a"), timeout=120
            )
        )
        return [(s.tokens, s.text) for s in result.samples.values()]

    def abuse() -> list[tuple[list[int], str]]:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return [sample for samples in pool.map(stream, range(8)) for sample in samples]

    samples, outputs, team_b_errors = during(noisy, abuse)
    assert isinstance(samples, list) and len(samples) == 32
    assert sum(len(tokens) for tokens, _ in samples) > 32 * 48  # most run to max_tokens (some meet EOS)
    for tokens, text in samples:
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    stray = sum(text.count("\ufffd") for _, text in samples)
    assert_team_b_unharmed(noisy, outputs, team_b_errors)
    total = sum(len(tokens) for tokens, _ in samples)
    figure(
        "noisy detokenization: team-a samples / tokens, U+FFFD in their text, team-b errors",
        f"{len(samples)} / {total}, {stray}, {len(team_b_errors)}",
    )


# --- case 14: GetStats --------------------------------------------------------------------------------------


def test_get_stats_shows_a_tenant_only_its_own_figures(noisy: Noisy) -> None:
    def stats(who: str) -> sampler_pb2.GetStatsResponse:
        response: sampler_pb2.GetStatsResponse = noisy.sampler.GetStats(
            sampler_pb2.GetStatsRequest(), metadata=noisy.md(who), timeout=60
        )
        return response

    def own_slots(who: str) -> int:
        listed = noisy.sampler.ListLoaded(sampler_pb2.ListLoadedRequest(), metadata=noisy.md(who), timeout=60)
        return len(listed.adapters)

    before = {who: stats(who) for who in ("team-a", "team-b", "ops")}
    team_b_tokens = WORKLOAD_ROUNDS * sum(len(t) for run in noisy.baseline for t in run.values())

    def abuse() -> list[sampler_pb2.GetStatsResponse]:  # team-a watches the sampler while team-b works
        seen = []
        for _ in range(40):
            seen.append(stats("team-a"))
        return seen

    seen, outputs, team_b_errors = during(noisy, abuse)
    assert_team_b_unharmed(noisy, outputs, team_b_errors)
    assert isinstance(seen, list) and len(seen) == 40
    for figures in seen:  # nothing of team-b's activity shows (its rate is of its own tokens, which stay the same)
        assert figures.tokens_generated == before["team-a"].tokens_generated
        assert figures.running_requests == figures.waiting_requests == 0 and figures.kv_cache_usage == 0.0
        assert figures.last_event_id == ""
        assert all(r.adapter.startswith("team-a/") for r in figures.recent_reloads)
    after = {who: stats(who) for who in ("team-a", "team-b", "ops")}
    assert after["team-b"].tokens_generated - before["team-b"].tokens_generated == team_b_tokens
    assert after["ops"].tokens_generated - before["ops"].tokens_generated >= team_b_tokens
    assert after["team-b"].running_requests == after["team-b"].waiting_requests == 0
    for who in ("team-a", "team-b"):  # its own slots, loads and reloads; the sampler's limits
        assert after[who].slots_used == own_slots(who) and after[who].slots_total == after["ops"].slots_total
        assert after[who].max_waiting == after["ops"].max_waiting
        assert all(r.adapter.startswith(f"{who}/") for r in after[who].recent_reloads)
    assert after["team-b"].adapter_loads_total >= 1 and after["team-b"].reloads_total == 0  # not followed
    assert after["team-a"].adapter_loads_total + after["team-b"].adapter_loads_total <= after["ops"].adapter_loads_total
    assert after["ops"].slots_used == own_slots("ops") >= after["team-a"].slots_used + after["team-b"].slots_used
    assert after["ops"].last_event_id != ""  # the admin sees the sampler's figures
