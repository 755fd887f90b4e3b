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
from tests.test_tinker_api import client, datums, gateway, key_for  # noqa: F401  (gateway: the fixture)

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")


def steps_then_left_open(gw, key: str) -> str:
    """Three steps and a save, as a loop does; the client's session is then closed, its model still the gateway's."""
    import tinker
    from tinker import types

    with client(gw, key) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        batch, _ = datums(tc.get_tokenizer(), types)
        for _ in range(3):
            tc.forward_backward(batch, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        tc.save_weights_for_sampler("s").result()
        tinker.RestClient(base_url=f"http://127.0.0.1:{gw.port}", api_key=key).list_checkpoints(tc.model_id).result()
        return tc.model_id


async def test_a_gateway_with_a_session_on_it_closes_in_seconds(nc, gateway):  # noqa: F811
    model = await asyncio.to_thread(steps_then_left_open, gateway, await key_for(nc, "acme"))
    assert model
    started = time.monotonic()
    await gateway.close()
    took = time.monotonic() - started
    assert took < LINGER_S / 3, f"the gateway took {took:.0f} s to close"
