"""The episode routes of the /v1 surface, each scoped to the caller's tenant (another tenant's episode is 404,
exactly like a missing one): read, reward, list, delete. The store and the capture are in episodes.py."""

from __future__ import annotations

from aiohttp import web

from opentinker.gateway.bodies import json_body
from opentinker.gateway.episodes import check_episode_id
from opentinker.gateway.errors import bad_request
from opentinker.gateway.state import gateway_of, principal_of

MAX_LIST = 1000
DEFAULT_LIST = 20


async def get_episode(request: web.Request) -> web.Response:
    gw, principal = gateway_of(request), principal_of(request)
    episode_id = check_episode_id(request.match_info["episode_id"])
    episode = await gw.episodes.get(principal.tenant, episode_id)
    return web.json_response(episode.to_json())


async def reward_episode(request: web.Request) -> web.Response:
    """``{"reward": x}`` for the episode, ``{"turn": i, "reward": x}`` for one turn; answers the episode."""
    gw, principal = gateway_of(request), principal_of(request)
    episode_id = check_episode_id(request.match_info["episode_id"])
    body = await json_body(request)
    episode = await gw.episodes.reward(principal.tenant, episode_id, body)
    return web.json_response(episode.to_json())


async def list_episodes(request: web.Request) -> web.Response:
    gw, principal = gateway_of(request), principal_of(request)
    raw = request.query.get("limit", str(DEFAULT_LIST))
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIST:  # isdigit alone: "²", int() refuses
        raise bad_request(f"limit must be an integer in [1, {MAX_LIST}], got {raw[:40]!r}")
    found = await gw.episodes.recent(principal.tenant, int(raw))
    data = [{"id": episode_id, "object": "episode", "updated_at": at} for episode_id, at in found]
    return web.json_response({"object": "list", "data": data})


async def delete_episode(request: web.Request) -> web.Response:
    gw, principal = gateway_of(request), principal_of(request)
    episode_id = check_episode_id(request.match_info["episode_id"])
    await gw.episodes.delete(principal.tenant, episode_id)
    return web.json_response({"id": episode_id, "object": "episode", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/episodes", list_episodes)
    app.router.add_get("/v1/episodes/{episode_id}", get_episode)
    app.router.add_post("/v1/episodes/{episode_id}/reward", reward_episode)
    app.router.add_delete("/v1/episodes/{episode_id}", delete_episode)
