"""The trainer SIGKILLed inside SaveSnapshot and SaveState: at every point between two file writes (armed with
OPENTINKER_FAULT_POINT, see rpc/process/faults.py) and at random moments of a save loop. One adapter is trained across
all the kills, each new trainer process resuming from the last SaveState that completed.

Afterwards: the registry references only complete artifacts, each of which loads; the last completed state
resumes bitwise (weights, gradients, AdamW moments, step) and equals an uninterrupted run; what the killed
writers left in the store's tmp/ is gone once the next trainer has started."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from faultutil import SOAK, ForkedServer, fork_trainer, kill_delays
from registryutil import unique_name
from safetensors.torch import load_file
from samplerutil import snapshot
from serverproc import ServerProcess, registry_store, start_registry
from trainerutil import assert_same_training, create, get_adapter, lora, read_state, save_state, sft_batch, train_step

from opentinker.rpc.process.faults import ENV_VAR
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from opentinker.weights.artifact_store import ArtifactStore

SEED = 7
CONFIG = lora(rank=4, alpha=8.0, dropout=0.1)  # dropout: the adapter's RNG must resume too
LABEL = "fault"
STATE_FILES = ("grads.safetensors", "optimizer.pt", "rng.pt", "state.json", "weights.safetensors")
SNAPSHOT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _store_points(scope: str, files: tuple[str, ...]) -> list[str]:
    writes = [f"{scope}/file_written:{name}" for name in files]  # commit_files writes in path order
    return [
        f"{scope}/temp_created",
        *writes,
        f"{scope}/manifest_written",
        f"{scope}/before_rename",
        f"{scope}/after_rename",
    ]


SNAPSHOT_POINTS = [
    *_store_points("save_snapshot", SNAPSHOT_FILES),
    "save_snapshot/before_publish",
    "save_snapshot/after_publish",
]
STATE_POINTS = [*_store_points("save_state", STATE_FILES), "save_state/before_reply"]
# Killed at these, the writer leaves its temp directory behind (before the rename into sha256/).
LEAVES_TEMP = {
    p
    for p in SNAPSHOT_POINTS + STATE_POINTS
    if p.split("/")[1].startswith(("temp_created", "file_written", "manifest_written", "before_rename"))
}
RANDOM_KILLS = 20 if SOAK else 2


def data(step: int) -> list[common_pb2.Datum]:
    return sft_batch(seed=500 + step, count=2, length=12)


@dataclass
class Saved:
    state_id: str
    step: int


@dataclass
class Kill:
    point: str  # a fault point, or "random@<delay>"
    exit_code: int
    client_code: grpc.StatusCode | None
    leftovers: set[str]  # tmp/ directory names right after the kill


@dataclass
class Campaign:
    name: str
    store: Path
    registry: ServerProcess
    kills: list[Kill] = field(default_factory=list)
    last: Saved | None = None
    resumed_identical: list[bool] = field(default_factory=list)  # a state saved right after resume == the last one
    cleaned: list[bool] = field(default_factory=list)  # leftovers of the previous kill gone after the next start
    final: ForkedServer | None = None


def temp_dirs(store: Path) -> set[str]:
    return {p.name for p in (store / "tmp").iterdir() if p.is_dir()}


def resume(stub: trainer_pb2_grpc.TrainerServiceStub, campaign: Campaign, *, verify: bool) -> None:
    if campaign.last is None:
        create(stub, campaign.name, seed=SEED, config=CONFIG, attach_existing=True)
        return
    adapter = create(
        stub, campaign.name, seed=SEED, config=CONFIG, attach_existing=True, resume_state=campaign.last.state_id
    )
    assert adapter.step == campaign.last.step
    if not verify:
        return  # this trainer is armed to die inside SaveState: the next one checks
    # Content-addressed: the same id means byte-identical weights, gradients, moments, RNG, step and ledger.
    campaign.resumed_identical.append(save_state(stub, campaign.name, LABEL) == campaign.last.state_id)


def step_and_save(stub: trainer_pb2_grpc.TrainerServiceStub, campaign: Campaign) -> Saved:
    step = get_adapter(stub, campaign.name).step
    train_step(stub, campaign.name, data(step))
    return Saved(save_state(stub, campaign.name, LABEL), step + 1)


def start(campaign: Campaign, workdir: Path, model: Path, env: dict[str, str]) -> ForkedServer:
    before = campaign.kills[-1].leftovers if campaign.kills else set()
    trainer = fork_trainer(workdir, model, campaign.registry, env=env)
    if before:
        campaign.cleaned.append(not (before & temp_dirs(campaign.store)))
    return trainer


def kill_at_point(campaign: Campaign, point: str, workdir: Path, model: Path) -> None:
    trainer = start(campaign, workdir, model, {ENV_VAR: point})
    code = None
    with grpc.insecure_channel(trainer.address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        resume(stub, campaign, verify=point.startswith("save_snapshot/"))
        try:
            if point.startswith("save_snapshot/"):
                campaign.last = step_and_save(stub, campaign)  # a state that completed before the kill
                stub.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=campaign.name), timeout=30)
            else:
                train_step(stub, campaign.name, data(get_adapter(stub, campaign.name).step))
                stub.SaveState(trainer_pb2.SaveStateRequest(adapter=campaign.name, label=LABEL), timeout=30)
        except grpc.RpcError as error:
            code = error.code()
    campaign.kills.append(Kill(point, trainer.wait(), code, temp_dirs(campaign.store)))


def kill_at_random(campaign: Campaign, delay: float, workdir: Path, model: Path) -> None:
    """Train-save-snapshot in a loop and SIGKILL the trainer after `delay` seconds, wherever it is."""
    trainer = start(campaign, workdir, model, {})
    codes: list[grpc.StatusCode] = []
    with grpc.insecure_channel(trainer.address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        resume(stub, campaign, verify=True)

        def loop() -> None:
            try:
                while True:
                    campaign.last = step_and_save(stub, campaign)
                    snapshot(stub, campaign.name)
            except grpc.RpcError as error:
                codes.append(error.code())

        worker = threading.Thread(target=loop)
        worker.start()
        stopped = threading.Event()
        stopped.wait(delay)
        exit_code = trainer.kill()
        worker.join(30)
    campaign.kills.append(
        Kill(f"random@{delay:.2f}s", exit_code, codes[0] if codes else None, temp_dirs(campaign.store))
    )


@pytest.fixture(scope="module")
def campaign(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Campaign]:
    workdir = tmp_path_factory.mktemp("trainer-kills")
    registry = start_registry(workdir / "registry")
    result = Campaign(unique_name("kills"), registry_store(registry), registry)
    try:
        points = [p for pair in itertools.zip_longest(STATE_POINTS, SNAPSHOT_POINTS) for p in pair if p]
        for index, point in enumerate(points):
            kill_at_point(result, point, workdir / f"t{index}", tiny_model)
        for index, delay in enumerate(kill_delays(SEED, RANDOM_KILLS, 0.2, 1.5)):
            kill_at_random(result, delay, workdir / f"r{index}", tiny_model)
        result.final = start(result, workdir / "final", tiny_model, {})
        yield result
    finally:
        if result.final is not None:
            result.final.terminate()
        assert registry.terminate() == 0, registry.log()


def test_trainer_died_at_every_fault_point(campaign: Campaign, figure: Callable[[str, object], None]) -> None:
    named = [k for k in campaign.kills if not k.point.startswith("random@")]
    assert sorted(k.point for k in named) == sorted(SNAPSHOT_POINTS + STATE_POINTS)
    for kill in campaign.kills:
        assert kill.exit_code == -9, kill  # SIGKILL: died at the armed point, nothing else
    for kill in named:
        assert kill.client_code == grpc.StatusCode.UNAVAILABLE, kill  # the client learns, it does not hang
    assert len(campaign.kills) >= 20
    figure(
        "trainer SIGKILLs inside SaveSnapshot/SaveState (fault points + random)",
        f"{len(named)} + {len(campaign.kills) - len(named)}",
    )


def test_registry_references_only_complete_loadable_artifacts(campaign: Campaign) -> None:
    with grpc.insecure_channel(campaign.registry.address) as channel:
        registry = registry_pb2_grpc.RegistryServiceStub(channel)
        versions = registry.ListVersions(registry_pb2.ListVersionsRequest(adapter=campaign.name, page_size=1000))
    numbers = sorted(v.version for v in versions.versions)
    # SaveSnapshot reached the registry in: each snapshot-point kill at or after after_publish, and random kills.
    assert len(numbers) >= 1 and numbers == list(range(1, len(numbers) + 1))
    store = ArtifactStore(campaign.store)
    keys: set[str] = set()
    for version in versions.versions:
        directory = store.path(version.artifact_uri)  # verifies every file's size and sha256
        tensors = load_file(directory / "adapter_model.safetensors")
        keys = keys or set(tensors)
        assert set(tensors) == keys and len(keys) >= 2
        assert {t.shape[0] for k, t in tensors.items() if k.endswith("lora_A.weight")} == {CONFIG.rank}
    assert campaign.final is not None
    with grpc.insecure_channel(campaign.final.address) as channel:
        trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
        for version in versions.versions:  # the trainer's own load path accepts every published version
            create(
                trainer, unique_name("init"), seed=SEED, config=CONFIG, init_from=f"{campaign.name}@{version.version}"
            )


def test_last_completed_state_resumes_bitwise(campaign: Campaign) -> None:
    assert campaign.last is not None and campaign.final is not None
    assert campaign.resumed_identical and all(campaign.resumed_identical), campaign.resumed_identical
    with grpc.insecure_channel(campaign.final.address) as channel:
        trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
        resumed = create(
            trainer, campaign.name, seed=SEED, config=CONFIG, attach_existing=True, resume_state=campaign.last.state_id
        )
        assert resumed.step == campaign.last.step
        assert save_state(trainer, campaign.name, LABEL) == campaign.last.state_id
        # An uninterrupted adapter trained on the same batches ends bitwise where the killed chain ended.
        reference = create(trainer, unique_name("ref"), seed=SEED, config=CONFIG).name
        for step in range(campaign.last.step):
            train_step(trainer, reference, data(step))
        want = read_state(campaign.store, save_state(trainer, reference, LABEL))
    assert_same_training(read_state(campaign.store, campaign.last.state_id), want)


def test_temp_leftovers_are_removed_at_next_start(campaign: Campaign) -> None:
    for kill in campaign.kills:
        if kill.point in LEAVES_TEMP:
            assert kill.leftovers, f"killed at {kill.point}, the writer left nothing in tmp/: the point was not inside"
    assert campaign.cleaned and all(campaign.cleaned), campaign.cleaned
    assert temp_dirs(campaign.store) == set()
