"""The RL loops' options are declared once (RLOptions): a name that is none of them is refused, not ignored."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from opentinker.client import loops
from opentinker.client.service_client import ServiceClient


def test_a_misspelt_option_is_refused_before_anything_is_sent() -> None:
    service = cast(ServiceClient, None)  # never reached: the options are checked first
    factory: Any = None
    misspelt: dict[str, Any] = {"group_sise": 4}
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['group_sise'\]"):
        loops.train_rl(service, "team-a/x", factory, steps=1, **misspelt)
    with pytest.raises(TypeError, match="group_sise"):
        asyncio.run(loops.train_multi_agent_rl_async(service, {"a": "team-a/x"}, factory, steps=1, **misspelt))


def test_defaults_are_the_documented_ones() -> None:
    config, _options = loops._resolve(3, {"seed": 9})
    assert (config.steps, config.group_size, config.groups_per_step, config.seed) == (3, 8, 4, 9)
    assert config.loss_fn == "importance_sampling" and not config.normalize_std
