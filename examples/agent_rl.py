"""An agent written only against the `openai` SDK, trained by RL through the gateway's trajectory capture.

The game: guess my number (0-9) in up to 3 turns, with "higher"/"lower" feedback each turn. Each game is one
episode (header X-OpenTinker-Episode); the agent is plain Python over `chat.completions.create` on
`team-a/guesser@latest`. Reward per game: the mean over its turns of the fraction of the reply that is digits (the
format a guess must have). What the tiny random model learns is that format, to answer in digits; it does not learn
to use the feedback (wins are reported, they stay luck: about 2 of 16 games), and a win reward alone would be far
too sparse for it.

The loop: play a group of games, attach their rewards (POST /v1/episodes/{id}/reward), read the captured
episodes (EpisodeClient), train on their exact tokens (train_on_episodes: importance_sampling -> optim_step ->
save_snapshot, the episode ids in the version's lineage); the sampler hot-reloads and the next games run on the new
version (the `model` of each answer says which).

Run: python examples/agent_rl.py [--run-dir agent-rl-run] [--iterations 8] [--games 16]  (starts and stops the stack;
about 35 s on 2 idle CPU cores)
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

from opentinker.client import AdamParams, EpisodeClient, LoraConfig, ServiceClient, train_on_episodes

ADAPTER = "team-a/guesser"
KEY = "tml-agent-rl-example-key"
OPENINGS = (
    "Guess my number from 0 to 9.",
    "I am thinking of a digit. Which one?",
    "Pick a number between 0 and 9.",
    "What number am I thinking of?",
)


def score(reply: str) -> float:
    return sum(c.isdigit() for c in reply) / len(reply) if reply else 0.0


def play(chat: OpenAI, episode_id: str, secret: int, opening: str, seed: int, turns: int) -> tuple[float, bool, str]:
    """One game; returns its reward, whether it won, and the exact version that played it."""
    messages: list[dict[str, str]] = [{"role": "user", "content": opening}]
    format_scores: list[float] = []
    won, model = False, ""
    for turn in range(turns):
        answer = chat.chat.completions.create(
            model=f"{ADAPTER}@latest",
            messages=messages,
            max_tokens=12,
            temperature=0.1,  # type: ignore[arg-type]
            seed=seed + turn,
            extra_headers={"X-OpenTinker-Episode": episode_id},
        )
        reply, model = answer.choices[0].message.content or "", answer.model
        format_scores.append(score(reply))
        digits = [int(c) for c in reply if c.isdigit()]
        messages.append({"role": "assistant", "content": reply})
        if digits and digits[0] == secret:
            won = True
            break
        hint = "Not a number." if not digits else ("Higher." if digits[0] < secret else "Lower.")
        messages.append({"role": "user", "content": hint})
    return sum(format_scores) / len(format_scores), won, model


def wait_for(chat: OpenAI, exact: str) -> None:
    """Until @latest is served as the version just saved (the sampler follows the registry's events: milliseconds)."""
    for _ in range(200):
        probe = chat.completions.create(model=f"{ADAPTER}@latest", prompt=[1, 2, 3], max_tokens=1)
        if probe.model == exact:
            return
        time.sleep(0.05)
    raise SystemExit(f"the sampler did not serve {exact} within 10 s")


def start(run: Path) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], dict[str, str], str]:
    subprocess.run(["opentinker", "make-tiny-model", str(run / "model")], check=True, capture_output=True)
    (run / "stack.toml").write_text(f'model = "{run}/model"\nport = 0\n[registry]\ndata_dir = "{run}/registry-data"\n')
    up = subprocess.Popen(["opentinker", "up", "--config", run / "stack.toml", "--workdir", run, "--json"], stdout=-1)
    servers = {name: s["address"] for name, s in json.loads(up.stdout.readline())["servers"].items()}  # type: ignore[union-attr]
    (run / "keys.json").write_text(json.dumps({"keys": [{"key": KEY, "tenant": "team-a"}]}))
    ready = run / "gateway.json"
    ready.unlink(missing_ok=True)
    gateway = subprocess.Popen(
        [
            "opentinker",
            "gateway",
            "serve",
            "--trainer",
            servers["trainer"],
            "--sampler",
            servers["sampler"],
            "--registry",
            servers["registry"],
            "--keys-file",
            run / "keys.json",
            "--port",
            "0",
            "--ready-file",
            ready,
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(run / "gateway.log", "wb"),  # noqa: SIM115
    )
    while not ready.exists():
        if gateway.poll() is not None:
            raise SystemExit(f"the gateway exited: {(run / 'gateway.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return up, gateway, servers, "http://" + json.loads(ready.read_text())["address"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=Path("agent-rl-run"))
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--games", type=int, default=16, help="games per iteration (one group), played at once")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=5e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON line per iteration")
    args = parser.parse_args()
    run = args.run_dir.resolve()
    up, gateway, servers, url = start(run)
    try:
        chat = OpenAI(base_url=f"{url}/v1", api_key=KEY)
        episodes = EpisodeClient(url, KEY)
        rng = random.Random(args.seed)
        with ServiceClient(servers["trainer"], servers["sampler"], servers["registry"]) as service:
            training = service.create_training_client(ADAPTER, LoraConfig(rank=8), seed=args.seed)
            training.save_snapshot()  # version 1: what the first games play
            for it in range(args.iterations):
                ids = [f"it{it}-game{g}" for g in range(args.games)]
                games = [
                    (i, rng.randrange(10), OPENINGS[g % len(OPENINGS)], rng.randrange(1 << 30))
                    for g, i in enumerate(ids)
                ]
                with ThreadPoolExecutor(len(games)) as pool:
                    played = list(pool.map(lambda game: play(chat, *game, args.turns), games))
                for episode_id, (reward, _, _) in zip(ids, played, strict=True):
                    episodes.reward(episode_id, reward)
                captured = [episodes.get(i) for i in ids]
                result = train_on_episodes(training, captured, adam=AdamParams(learning_rate=args.learning_rate))
                line = {
                    "iteration": it,
                    "mean_reward": round(result.mean_reward, 4),
                    "wins": sum(won for _, won, _ in played),
                    "played_by": sorted({model for *_, model in played}),
                    "mismatches": sum(e.mismatches for e in captured),
                    "saved": result.version.number if result.version else None,
                }
                print(json.dumps(line) if args.json else line, flush=True)
                if result.version is not None:
                    wait_for(chat, result.version.reference)
    finally:
        gateway.terminate()
        gateway.wait()
        up.terminate()
        up.wait()


if __name__ == "__main__":
    sys.exit(main())
