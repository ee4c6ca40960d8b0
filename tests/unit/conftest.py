"""The guest agent's unit tests run on both event loops the guest may give it.

The image installs Debian's python3-uvloop and the agent runs on it
(:func:`cryobox.guest.agent.new_loop`); without it, on asyncio's own loop. Their
differences (how a hang-up is reported, when a callback runs) are where a channel bug
would hide, so every test that serves the real agent runs on each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

LoopFactory = Callable[[], asyncio.AbstractEventLoop]
ASYNCIO: dict[str, LoopFactory] = {"asyncio": asyncio.new_event_loop}

try:  # pinned as Debian 12's, for the Python 3.11 the guest has
    import uvloop
except ImportError:  # another Python: the agent's tests run on asyncio's loop only
    AGENT_LOOPS = ASYNCIO
else:
    AGENT_LOOPS = {**ASYNCIO, "uvloop": uvloop.new_event_loop}

#: Test modules that serve the real guest agent on their loop.
AGENT_MODULES = {"test_agent.py", "test_hostile_peer.py"}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, LoopFactory]:
    return AGENT_LOOPS if item.path.name in AGENT_MODULES else ASYNCIO
