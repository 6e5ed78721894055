"""The OpenAI-compatible routes under /v1, next to the tinker routes in the same gateway process:
GET /v1/models, GET /v1/models/{id} (models.py), POST /v1/chat/completions, POST /v1/completions
(completions.py).

``model`` is any reference of the caller's tenant (``team/agent`` = its serving alias, ``team/agent@stable``,
``team/agent@12``, a bare ``agent`` = ``<tenant>/agent``) or the base model's id; another tenant's adapter is
answered 404 exactly like a missing one. Each request is one Sample stream per prompt on the sampler (the n
choices are its num_samples), pinned to one exact version at admission: the answer's ``model`` names it."""

from __future__ import annotations

from aiohttp import web

from opentinker.gateway.openai import completions, models


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", models.list_models)
    app.router.add_get("/v1/models/{model:.+}", models.get_model)
    app.router.add_post("/v1/chat/completions", completions.chat_completions)
    app.router.add_post("/v1/completions", completions.completions)
