"""A gateway whose NATS is gone exits soon after SIGTERM (#63): it ran Tinker models (each given back at close by a
write to the store) and held its liveness record (deleted at close); with the bus away each of those writes waited
its timeout, one after another, and the gateway ran past its shutdown timeout (15 s; more with requests in flight,
which aiohttp gave 60 s). Real processes: `jetlora up` (its nats-server, the scheduler, the artifact service, an
agent offering its CPU with the real trainer) and a `jetlora gateway`; two training models of a tenant run on the
gateway when `jetlora up`, and with it the nats-server, is stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import nats
import pytest

from services.embedded import free_port
from tests.conftest import ROOT, wait_for, wait_nodes
from tests.test_tinker_api import datums, key_for
from tests.test_tinker_store import listening

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")
EXIT_S = 10.0  # the promise: well within the gateway's 15 s shutdown timeout


def two_models_trained(port: int, key: str) -> list:
    """Two training clients of one session, a step each: both models' calls run on this gateway now. The client
    is not closed (its session stays, as a client cut off with its gateway)."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key)
    clients = [sc.create_lora_training_client(base_model="tiny", rank=4, seed=n, train_unembed=False).result()
               for n in range(2)]  # fmt: skip
    batch, _ = datums(clients[0].get_tokenizer(), types)
    for tc in clients:
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return [sc, *clients]


def service(*args: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env, **kw)


async def test_a_gateway_whose_nats_is_gone_exits_soon_after_sigterm(tmp_path, tiny_model):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    up = service("up", "--port", "0", "--offer-cpu", "--node", "box", env=env, text=True, stdout=subprocess.PIPE,
                 stderr=open(tmp_path / "up.log", "w"))  # fmt: skip
    gateway, port = None, free_port()
    try:
        url = await asyncio.to_thread(nats_url, up)
        gateway = service("gateway", "--nats", url, "--port", str(port), "--base-model", f"tiny={tiny_model}",
                          "--accelerator", "cpu", env=env, stderr=open(tmp_path / "gateway.log", "w"))  # fmt: skip
        nc = await nats.connect(url)
        await wait_nodes(nc, 1, timeout=60)
        await wait_for(lambda: listening(port), timeout=60, what="the gateway listening")
        kept = await asyncio.to_thread(two_models_trained, port, await key_for(nc, "acme"))
        await nc.close()
        up.terminate()  # its nats-server with it
        await asyncio.to_thread(up.wait, 60)
        start = time.monotonic()
        gateway.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(gateway.wait, 60)
        took = time.monotonic() - start
        del kept
    finally:
        for proc in (gateway, up):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    text = (tmp_path / "gateway.log").read_text()
    print(f"the gateway exited {code} {took:.1f}s after SIGTERM")
    assert took < EXIT_S, f"the gateway took {took:.1f}s to exit with its NATS gone:\n{text[-3000:]}"
    assert code == 0, f"exit code {code}:\n{text[-3000:]}"


def nats_url(up: subprocess.Popen) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if line.startswith("NATS at "):
            return line.split()[2]
        if not line and up.poll() is not None:
            break
    raise AssertionError("jetlora up did not say its NATS URL")
