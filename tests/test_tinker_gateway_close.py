"""A gateway's close gives its models back in seconds, whatever its pumps were doing: a pump's cancel can be lost on
its way (Python 3.11's wait_for returns a store reply that came in the same turn as the cancel, and drops the
cancel), and a pump that went on waited out LINGER_S (60 s) for its next call before the close could give its model
back: every stop of a gateway with a session on it took a minute."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from services.gateway.tinker.order import LINGER_S
from tests.test_tinker_api import gateway, key_for  # noqa: F401  (gateway: the fixture)
from tests.test_tinker_exports import export

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")


async def test_a_gateway_with_a_session_on_it_closes_in_seconds(nc, gateway, tmp_path):  # noqa: F811
    """Steps, an export and its downloads, as test_tinker_exports does (whose teardown took 60 s every run)."""
    out = await asyncio.to_thread(export, gateway, await key_for(nc, "acme"), await key_for(nc, "globex"), tmp_path)
    assert out["model"]
    started = time.monotonic()
    await gateway.close()
    took = time.monotonic() - started
    assert took < LINGER_S / 3, f"the gateway took {took:.0f} s to close"
