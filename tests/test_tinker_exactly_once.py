"""A Tinker call's effect happens once even when the gateway that ran it dies between the node's answer and the
store's write of the outcome, and the session pauses before another gateway takes over: the next gateway resumes
the session and sends the call again under its call id, and the resumed trainer answers it as it was (the ids of
the calls it applied came back with its checkpoint). Real processes: the official client through a front that a
load balancer would be, the first gateway a process whose NATS connection passes a fault proxy that drops its
outcome writes, killed with SIGKILL; an agent and its trainer as processes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import msgspec
import pytest

from schemas import names, nats_subjects
from schemas.jobs import Error
from schemas.job_status import JobQuery, JobReply
from schemas.tinker_store import FutureRecord, GatewayRecord, ModelRecord, gateway_key, model_key, token
from services import bus
from services.gateway.app import Gateway
from services.gateway.tinker.outcomes import NORM_METRIC, STEP_METRIC
from tests.conftest import get_job, wait_for, wait_nodes
from tests.harness.proxy import NatsProxy
from tests.test_tinker_api import datums, key_for
from tests.test_tinker_sessions import job_of
from tests.test_tinker_store import RoundRobin, gateway_process, listening, models

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")
LR = 1e-2


class Client:
    """The official client's training loop, each call a future (the client sends it at once, in its order)."""

    def __init__(self, port: int, key: str) -> None:
        import tinker
        from tinker import types

        self.types = types
        self.sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key)
        self.tc = self.sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        self.batch, _ = datums(self.tc.get_tokenizer(), types)

    def fb(self):
        return self.tc.forward_backward(self.batch, "cross_entropy")

    def step(self):
        return self.tc.optim_step(self.types.AdamParams(learning_rate=LR))

    def reference(self, path: str) -> list[dict]:
        """From the state saved after step 1, the same three calls run plainly: what the optim_steps answer."""
        self.tc.load_state_with_optimizer(path).result()
        out = []
        for _ in range(2):
            self.fb().result()
            out.append(self.step().result().metrics)
        return out


async def _seqs(nc, model: str) -> list[int]:
    futures = await nc.jetstream().key_value(names.TINKER_FUTURES_KV)
    prefix = f"call.acme.{token(model)}."
    return [int(k.removeprefix(prefix)) for k in await futures.keys() if k.startswith(prefix)]


def _outcome_subject(model: str, seq: int) -> str:
    return nats_subjects.kv(names.TINKER_FUTURES_KV).prefix + f"call.acme.{token(model)}.{seq}"


async def test_a_call_whose_gateway_died_before_storing_its_outcome_runs_once_after_a_pause(
    nc, stack, tiny_model, agents, nats_server, tmp_path
):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = NatsProxy(nats_server.url).start()
    doomed = gateway_process(proxy.url, port, tiny_model, open(tmp_path / "doomed.log", "ab"))
    survivor = Gateway(nc, models(tiny_model), port=0)
    await survivor.start()
    front = RoundRobin([port])  # a load balancer in front of the gateways: first the doomed one
    try:
        await wait_for(lambda: listening(port), timeout=60, what="the first gateway listening")
        client = await asyncio.to_thread(Client, await front.start(), await key_for(nc, "acme"))
        model = client.tc.model_id  # made on the doomed gateway: it runs the model's calls
        first = await asyncio.to_thread(lambda: [f.result() for f in (client.fb(), client.step())])
        saved = await asyncio.to_thread(lambda: client.tc.save_state("one").result().path)
        front.ports[0] = survivor.port  # the client's requests reach the survivor; the doomed one still runs them

        last = max(await _seqs(nc, model))  # the next calls: a forward_backward, an optim_step, a forward_backward
        proxy.hold_writes((_outcome_subject(model, last + 2), _outcome_subject(model, last + 3)), mode="drop")
        sent = await asyncio.to_thread(lambda: (client.fb(), client.step(), client.fb()))
        await wait_for(lambda: proxy.stats["dropped"] >= 2, timeout=60,
                       what="the node's answers to the optim_step and the last forward_backward, their outcomes dropped")  # fmt: skip
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        futures, kv = [await nc.jetstream().key_value(b) for b in (names.TINKER_FUTURES_KV, names.TINKER_KV)]
        lost = [
            msgspec.json.decode((await futures.get(f"call.acme.{token(model)}.{seq}")).value, type=FutureRecord)
            for seq in (last + 2, last + 3)
        ]
        assert [(f.kind, f.outcome) for f in lost] == [("optim", None), ("forward", None)], lost

        doomed_id = msgspec.json.decode((await kv.get(model_key("acme", model))).value, type=ModelRecord).pump
        beats = asyncio.create_task(_beat_for(kv, doomed_id))  # nobody takes over until the session has paused
        job = await job_of(nc, model)  # the client goes quiet: its session pauses (as idle or silent)
        await bus.request(nc, names.jobs_api("acme").pause, JobQuery(job.id), JobReply | Error)
        await wait_for(lambda: _paused(nc, job.id), timeout=60, what="the session paused, its checkpoint stored")
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
        await kv.delete(gateway_key(doomed_id))  # gone, as LIVE_S after its last beat (saves the test 15 s)

        def rest() -> tuple[dict, dict, list[dict]]:
            resent = sent[1].result().metrics  # the survivor takes the model over and sends both again
            sent[2].result()
            after = client.step().result().metrics
            return resent, after, client.reference(saved)

        resent, after, reference = await asyncio.to_thread(rest)
        client.sc.close("success")
    finally:
        await front.close()
        await survivor.close()
        if doomed.poll() is None:
            doomed.kill()
        proxy.close()
    assert first[1].metrics[STEP_METRIC] == 1.0
    assert resent[STEP_METRIC] == 2.0, resent  # 3: the optim_step ran again, on the next call's gradient
    assert after[STEP_METRIC] == 3.0, after
    assert resent[NORM_METRIC] == pytest.approx(reference[0][NORM_METRIC], rel=1e-4)
    assert after[NORM_METRIC] == pytest.approx(reference[1][NORM_METRIC], rel=1e-4)  # doubled: run twice


async def _beat_for(kv, gateway: str) -> None:
    """The dead gateway's liveness record kept fresh, as if it were only slow."""
    while True:
        await kv.put(gateway_key(gateway), msgspec.json.encode(GatewayRecord(id=gateway, started=time.time())))
        await asyncio.sleep(1.0)


async def _paused(nc, job_id: str) -> bool:
    job = await get_job(nc, job_id)
    return job.state == "paused"
