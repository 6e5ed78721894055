"""Fixtures of the reliability tests: private server stacks (registry + trainer + sampler) per module, and
figures (fuzz cases, latency, memory) that tests record and the run prints at its end."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from serverproc import ServerProcess, start_registry, start_sampler, start_trainer

_FIGURES: list[tuple[str, str]] = []


@pytest.fixture(scope="module")
def start_stack(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., dict[str, ServerProcess]]]:
    """Starts a private stack {"registry", "trainer", "sampler"} (own embedded Redis and store) on the tiny
    model; all stop when the module ends, each by SIGTERM with exit code 0 (a crash or hang fails teardown)."""
    started: list[ServerProcess] = []

    def start(
        label: str,
        *,
        registry_args: tuple[str, ...] = (),
        trainer_args: tuple[str, ...] = (),
        sampler_args: tuple[str, ...] = (),
    ) -> dict[str, ServerProcess]:
        workdir = tmp_path_factory.mktemp(label)
        registry = start_registry(workdir / "registry", *registry_args)
        started.append(registry)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both load the model: in parallel
            trainer = pool.submit(start_trainer, workdir / "trainer", tiny_model, registry, *trainer_args)
            sampler = pool.submit(start_sampler, workdir / "sampler", tiny_model, registry, *sampler_args)
            for future in (trainer, sampler):
                if future.exception() is None:
                    started.append(future.result())
        return {"registry": registry, "trainer": trainer.result(), "sampler": sampler.result()}

    yield start
    for server in started:  # SIGTERM to all first: they drain in parallel
        if server.process.poll() is None:
            server.process.terminate()
    for server in started:  # a second SIGTERM after the handlers are gone would kill: wait before terminate()
        server.process.wait(60)
    codes = {server.log_path.parent.name: server.terminate() for server in reversed(started)}
    assert set(codes.values()) <= {0}, codes


@pytest.fixture
def figure(record_property: Callable[[str, object], None]) -> Callable[[str, object], None]:
    """Records a measured figure in the test's report: junit properties, and the run's closing summary
    (tests/conftest.py prints every report's properties, so the figures also reach it from xdist workers)."""
    return record_property


@pytest.fixture(scope="module")
def module_figure() -> Callable[[str, object], None]:
    """Records a figure in the run's closing summary from a module-scoped fixture (a module's totals, which no one
    test's report holds). Printed by a run in one process; under xdist a worker's summary is not shown."""

    def record(name: str, value: object) -> None:
        _FIGURES.append((name, str(value)))

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("reliability figures")
        for name, value in _FIGURES:
            terminalreporter.write_line(f"{name}: {value}")
