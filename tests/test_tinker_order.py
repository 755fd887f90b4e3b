"""A model's calls in their order: a seq_id the gateway failed after the gap timeout never comes back as a turn to
wait for (a client that then pauses goes on where it was, no turn failed that it did not lose); and a fault's 500
carries one request id, in its header, its body and the log, and is counted in /healthz."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import aiohttp
import msgspec
import pytest

from schemas import names
from schemas.tinker_store import FutureRecord, ModelRecord, Outcome, call_key, model_key, ordered_request
from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker.bounds import Bounds
from services.gateway.tinker.futures import Book
from services.gateway.tinker.mirror import Mirror
from services.gateway.tinker.order import Order
from services.gateway.tinker.outcomes import Runner
from services.gateway.tinker.saves import Saves
from services.gateway.tinker.settings import TinkerSettings
from services.gateway.tinker.store import Store
from services.gateway.tinker.trainers import Trainers
from tests.conftest import wait_for
from tests.test_tinker_api import key_for
from tests.test_tinker_bounds import Api

pytestmark = pytest.mark.timeout(180)
os.environ.setdefault("TINKER_TELEMETRY", "0")
GAP_S = 1.0


@pytest.fixture
async def gateway(stack, nc, tiny_model):
    settings = TinkerSettings(gap_s=GAP_S)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0, tinker_settings=settings)
    await gw.start()
    yield gw
    await gw.close()


async def stored_kinds(nc, tenant: str, model: str, seqs: range) -> dict[int, str]:
    """The kind of each of the model's calls the store holds ("skipped": its turn was failed by the gateway)."""
    kv = await nc.jetstream().key_value(names.TINKER_FUTURES_KV)
    out = {}
    for seq in seqs:
        try:
            entry = await kv.get(call_key(tenant, ordered_request(model, seq)))
        except Exception:  # no such key
            continue
        if entry.value:
            out[seq] = msgspec.json.decode(entry.value, type=FutureRecord).kind
    return out


async def test_a_skips_own_write_heard_back_before_its_ack_does_not_fail_the_turns_after_it(nc):
    """The gateway fails a lost seq_id after the gap timeout by storing a "skipped" outcome in its turn. Here the
    store's echo of that write is heard, and the key read back, before the write's own acknowledgement (as on a busy
    gateway): that turn must not come back as a call still to run, or the model's order keeps waiting on a turn
    already past and fails every next seq_id one after another once the gap timeout passes (issue 57)."""
    store = await Store(nc).open()
    mirror, book = Mirror(store), Book(store)
    runner = Runner(store, book, Trainers(nc, store), Saves(store, Bounds(store, TinkerSettings())))
    order = Order(store, mirror, book, runner, "gw-test", TinkerSettings(gap_s=GAP_S))
    mirror.on_call = order.written
    await mirror.start()
    real_record = book.record

    async def heard_before_acked(future: FutureRecord):  # the echo and its read back, then the acknowledgement
        stored = await real_record(future)
        if future.kind == "skipped":
            owned = order.owned[future.model]
            await order._fetch(owned, future.tenant, future.id)
        return stored

    book.record = heard_before_acked  # type: ignore[method-assign]
    model = "s-order:train:0"
    record = ModelRecord(id=model, tenant="acme", session="s-order", base_model="tiny", pump="gw-test")
    revision = await store.create(store.kv, model_key("acme", model), record)
    done = Outcome(json={"model_id": model, "type": "create_model"})

    def call(seq: int) -> FutureRecord:  # calls whose outcome is known at the door: the order alone is tested
        return FutureRecord(id=ordered_request(model, seq), tenant="acme", model=model, seq=seq, kind="refused",
                            outcome=done, created=time.time())  # fmt: skip

    try:
        order.start_new(record, revision, (await book.record(call(0))) or call(0))
        await order.arrived(await book.record(call(2)))  # seq 1 lost: it fails after the gap, and 2 takes its turn
        owned = order.owned[model]
        await wait_for(lambda: owned.record.next_seq == 3, timeout=10 * GAP_S, what="seq 1 skipped and seq 2 run")
        quiet = time.monotonic()
        while time.monotonic() - quiet < 3 * GAP_S:  # the client says nothing for several gap timeouts
            await asyncio.sleep(0.1)
        kinds = await stored_kinds(nc, "acme", model, range(0, 40))
        assert kinds == {0: "refused", 1: "skipped", 2: "refused"}, kinds  # no turn after the client's last failed
        assert owned.record.next_seq == 3 and not owned.arrived, (owned.record.next_seq, owned.arrived)
        await order.arrived(await book.record(call(3)))  # the client goes on: its next call takes its turn
        await wait_for(lambda: owned.record.next_seq == 4, timeout=5, what="seq 3 run")
    finally:
        await order.close()
        await mirror.close()


async def test_a_faults_500_carries_one_request_id_in_header_body_and_log_and_is_counted(
    nc, gateway, monkeypatch, caplog
):
    from services.gateway.tinker import training

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in the gateway")

    url = f"http://127.0.0.1:{gateway.port}"
    async with Api(gateway, await key_for(nc, "acme")) as acme, aiohttp.ClientSession() as plain:
        async with plain.get(f"{url}/healthz") as r:
            before = (await r.json())["faults"]
        session = (await acme.ok("create_session", {}))["session_id"]
        model = await acme.model(session)
        monkeypatch.setattr(training, "checked", broken)
        with caplog.at_level(logging.ERROR):
            async with acme.http.post(f"{acme.url}/optim_step", json={"model_id": model, "seq_id": 1}) as r:
                body, header = await r.json(), r.headers["x-request-id"]
                assert r.status == 500, body
        assert header == body["request_id"] and header in body["detail"], (header, body)
        assert [rec for rec in caplog.records if header in rec.getMessage() and rec.exc_info], caplog.records
        async with plain.get(f"{url}/healthz") as r:
            assert (await r.json())["faults"] == before + 1
        async with acme.http.post(f"{acme.url}/session_heartbeat", json={"session_id": session}) as r:
            assert r.status == 200 and r.headers["x-request-id"] != header  # every answer its own id
