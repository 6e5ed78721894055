"""Captured episodes -> RL datums -> a trained, published version (the agent loop of the /v1 surface).

An agent written against the ``openai`` SDK sends ``X-OpenTinker-Episode: <id>`` (or ``metadata.episode_id``) with
each completion; the gateway records every turn's exact prompt and completion token ids, logprobs and version.

    episodes = EpisodeClient("http://127.0.0.1:7073", "tml-team-a-secret")
    episodes.reward("game-1", 1.0)
    played = [episodes.get(i) for i in ids]
    result = train_on_episodes(training, played)  # forward_backward -> optim_step -> save_snapshot

Datums are built from the recorded turns with the same layout as trajectories (trajectory.py): one datum per
segment, ``model_input`` = tokens[:-1], ``target_tokens`` = tokens[1:], weights 1 on completion tokens, the
sampler's logprobs, advantages = the episode's reward minus its group's mean. The SDK talks HTTP with the standard
library only; it imports no server package.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentinker.client.datum import Datum
from opentinker.client.registry_types import Version
from opentinker.client.training_client import TrainingClient
from opentinker.client.training_types import AdamParams, ForwardBackwardOutput
from opentinker.client.trajectory import Trajectory, Transition, group_advantages, trajectory_to_datums

__all__ = [
    "Episode",
    "EpisodeClient",
    "EpisodeConstraint",
    "EpisodeError",
    "EpisodeSegment",
    "EpisodeTrainResult",
    "EpisodeTurn",
    "episode_datums",
    "train_on_episodes",
]

EPISODE_HEADER = "X-OpenTinker-Episode"


@dataclass(frozen=True, slots=True)
class EpisodeConstraint:
    """The grammar a turn was sampled under (response_format or a forced tool call): its logprobs are of the masked,
    renormalized distribution, not the policy's own (docs/structured.md: what an RL loop does about it)."""

    kind: str  # "json_object", "json_schema" or "lark" (the sampler's Constraint kinds)
    source: str  # the schema's JSON text or the Lark grammar; "" for json_object
    origin: str  # the request field that forced it: "response_format" or "tool_choice"


@dataclass(frozen=True, slots=True)
class EpisodeTurn:
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    model: str  # the exact version that sampled it, "tenant/name@12"
    finish_reason: str
    request_id: str
    started_at: float
    finished_at: float
    constraint: EpisodeConstraint | None = None  # None: sampled free


@dataclass(frozen=True, slots=True)
class EpisodeSegment:
    turns: tuple[int, ...]
    token_ids: tuple[int, ...]
    mask: tuple[int, ...]  # 1 on completion tokens
    logprobs: tuple[float, ...]  # the sampler's, 0.0 on prompt tokens


@dataclass(frozen=True, slots=True)
class Episode:
    id: str
    turns: tuple[EpisodeTurn, ...]
    segments: tuple[EpisodeSegment, ...]
    episode_reward: float | None
    turn_rewards: dict[int, float]
    mismatches: int

    @property
    def total_reward(self) -> float:
        """The episode's reward plus every turn's (0.0 when none was attached)."""
        return (self.episode_reward or 0.0) + math.fsum(self.turn_rewards.values())

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Episode:
        """The gateway's GET /v1/episodes/{id} answer."""
        rewards: dict[str, Any] = raw.get("rewards") or {}
        episode_reward = rewards.get("episode")
        return cls(
            id=str(raw["id"]),
            turns=tuple(_turn(t) for t in raw["turns"]),
            segments=tuple(
                EpisodeSegment(tuple(s["turns"]), tuple(s["token_ids"]), tuple(s["mask"]), tuple(s["logprobs"]))
                for s in raw["segments"]
            ),
            episode_reward=None if episode_reward is None else float(episode_reward),
            turn_rewards={int(k): float(v) for k, v in (rewards.get("turns") or {}).items()},
            mismatches=int(raw["mismatches"]),
        )


def _turn(t: dict[str, Any]) -> EpisodeTurn:
    return EpisodeTurn(
        tuple(t["prompt_token_ids"]),
        tuple(t["token_ids"]),
        tuple(float(v) for v in t["logprobs"]),
        str(t["model"]),
        str(t["finish_reason"]),
        str(t["request_id"]),
        float(t["started_at"]),
        float(t["finished_at"]),
        _constraint(t.get("constraint")),
    )


def _constraint(raw: dict[str, Any] | None) -> EpisodeConstraint | None:
    if raw is None:
        return None
    return EpisodeConstraint(str(raw["kind"]), str(raw["source"]), str(raw["origin"]))


class EpisodeError(Exception):
    """An error answer of the episode routes: ``status`` and the gateway's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class EpisodeClient:
    """The gateway's /v1/episodes routes. ``base_url``: the gateway (``http://host:port``, a trailing ``/v1`` is
    accepted, as the openai SDK's base_url has it); ``api_key``: the tenant's key."""

    def __init__(self, base_url: str, api_key: str, timeout: float = 30.0) -> None:
        root = base_url.rstrip("/")
        self.base_url = root[: -len("/v1")] if root.endswith("/v1") else root
        self._api_key = api_key
        self._timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, object] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.base_url}/v1{path}", data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._api_key}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as answer:
                return json.loads(answer.read())  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                error = json.loads(raw)["error"]
                message = error["message"] if isinstance(error, dict) else str(error)
            except (ValueError, KeyError, TypeError):
                message = raw.decode(errors="replace")[:500]
            raise EpisodeError(exc.code, message) from None

    @staticmethod
    def _quoted(episode_id: str) -> str:
        return urllib.parse.quote(episode_id, safe="")

    def get(self, episode_id: str) -> Episode:
        return Episode.from_json(self._call("GET", f"/episodes/{self._quoted(episode_id)}"))

    def reward(self, episode_id: str, reward: float, turn: int | None = None) -> Episode:
        """Attaches a reward to the episode, or to one of its turns (replacing an earlier one)."""
        body: dict[str, object] = {"reward": float(reward)} if turn is None else {"turn": turn, "reward": reward}
        return Episode.from_json(self._call("POST", f"/episodes/{self._quoted(episode_id)}/reward", body))

    def list(self, limit: int = 20) -> list[str]:
        """The tenant's most recently written episode ids, newest first."""
        found = self._call("GET", f"/episodes?limit={int(limit)}")["data"]
        return [str(item["id"]) for item in found]

    def delete(self, episode_id: str) -> None:
        self._call("DELETE", f"/episodes/{self._quoted(episode_id)}")


def _trajectory(episode: Episode) -> Trajectory:
    # Turns as transitions: trajectory_to_datums cuts them where episodes.py cut the segments (the same rule).
    transitions = tuple(
        Transition(turn.prompt_token_ids, turn.token_ids, turn.logprobs) for turn in episode.turns if turn.token_ids
    )
    return Trajectory(transitions, trace_id=episode.id)


def episode_datums(
    episodes: Sequence[Episode], advantages: Sequence[float] | None = None, *, include_logprobs: bool = True
) -> list[Datum]:
    """One datum per segment of every episode, with the exact recorded tokens (see the module docstring).

    ``advantages``: one per episode; None: the episodes are one group, advantage = total reward - the group's mean
    (`group_advantages`). Datums whose advantage is 0 are kept (cross_entropy uses the same datums).
    """
    values = group_advantages([e.total_reward for e in episodes]) if advantages is None else list(advantages)
    if len(values) != len(episodes):
        raise ValueError(f"{len(values)} advantages for {len(episodes)} episodes")
    datums: list[Datum] = []
    for episode, advantage in zip(episodes, values, strict=True):
        trajectory = _trajectory(episode)
        if trajectory.transitions:
            datums += trajectory_to_datums(trajectory, advantage, include_logprobs=include_logprobs)
    return datums


@dataclass(frozen=True, slots=True)
class EpisodeTrainResult:
    """``version``: the snapshot saved (None when every advantage was 0: nothing to learn, nothing saved)."""

    version: Version | None
    num_datums: int
    mean_reward: float
    output: ForwardBackwardOutput | None


def train_on_episodes(
    training_client: TrainingClient,
    episodes: Sequence[Episode],
    loss: str = "importance_sampling",
    *,
    advantages: Sequence[float] | None = None,
    adam: AdamParams | None = None,
    loss_fn_config: dict[str, float] | None = None,
) -> EpisodeTrainResult:
    """forward_backward (the episode ids as trace ids, so they reach the version's lineage) -> optim_step ->
    save_snapshot (metrics: mean_reward). Datums with advantage 0 carry no policy gradient and are dropped."""
    rewards = [e.total_reward for e in episodes]
    mean = math.fsum(rewards) / len(rewards) if rewards else 0.0
    datums = [
        d for d in episode_datums(episodes, advantages) if any(v != 0 for v in d.loss_fn_inputs["advantages"].data)
    ]
    if not datums:
        return EpisodeTrainResult(None, 0, mean, None)
    output = training_client.forward_backward(datums, loss, loss_fn_config, trace_ids=[e.id for e in episodes])
    training_client.optim_step(adam)
    version = training_client.save_snapshot(metrics={"mean_reward": mean, "episodes": float(len(episodes))})
    return EpisodeTrainResult(version, len(datums), mean, output)
