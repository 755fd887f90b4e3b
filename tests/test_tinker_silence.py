"""A Tinker client killed while it holds a training client frees its device within a minute (three missed
heartbeats pause its session: checkpointed, the device freed), and a new client of the same tenant trains on the
one device there is; the killed session's model would resume from its checkpoint at its next call."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from schemas.job_status import TERMINAL_STATES
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from tests.conftest import ROOT, get_job, list_nodes, wait_for, wait_nodes
from tests.test_tinker_api import key_for
from tests.test_tinker_sessions import Loop, job_of

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")
HOLDER = """
import sys, time
import tinker
from tinker import types
sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                     loss_fn_inputs={"target_tokens": [2, 3, 4]})], "cross_entropy").result()
print(tc.model_id, flush=True)
time.sleep(600)
"""


async def _device_free(nc) -> bool:
    return all(not d.jobs for n in await list_nodes(nc) for d in n.devices)


async def test_a_killed_clients_device_is_free_within_a_minute_and_a_new_client_trains(nc, stack, tiny_model, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0)  # default settings
    await gw.start()
    key = await key_for(nc, "acme")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TINKER_TELEMETRY": "0"}
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, f"http://127.0.0.1:{gw.port}", key, stdout=subprocess.PIPE, env=env
    )
    try:
        assert holder.stdout is not None
        model_id = (await asyncio.wait_for(holder.stdout.readline(), 120)).decode().strip()
        assert not await _device_free(nc)
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        await holder.wait()
        await wait_for(lambda: _device_free(nc), timeout=60, interval=0.5, what="the killed client's device free")
        print(f"device free {time.monotonic() - killed:.1f} s after the client was killed")
        job_id = (await job_of(nc, model_id)).id

        async def settled():  # the device is free by the node's heartbeat, its job's state comes by another way
            j = await get_job(nc, job_id)
            return j if j.state == "paused" or j.state in TERMINAL_STATES else None

        job = await wait_for(settled, timeout=30, what="the killed client's job paused")
        assert job.state == "paused", job  # checkpointed: resumable at its next call

        def new_client() -> float:
            loop = Loop(gw, key)
            loop.step()
            out = loop.tc.forward(loop.batch, "cross_entropy").result().metrics["loss:sum"]
            loop.sc.close("success")
            return out

        assert await asyncio.wait_for(asyncio.to_thread(new_client), 120) > 0
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
        await gw.close()
