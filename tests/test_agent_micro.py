"""The agent serves its node's subjects as a nats.micro service, as every other service does: under the generated
permissions its endpoints (assign, control, reclaim, session, evaluate) show in $SRV discovery with its node, its
error replies count in $SRV.STATS, and a command of an older scheduler term is still refused."""

from __future__ import annotations

import asyncio

import msgspec

from schemas import names, nats_subjects
from schemas.nodes import Control, ControlReply
from services import bus
from services.agent.config import AgentConfig
from services.agent.engines import Engine
from services.agent.service import Agent
from tests.conftest import wait_for
from tests.test_permissions import as_user, secured  # noqa: F401 (the fixture)

ENDPOINTS = {"assign", "control", "reclaim", "session", "evaluate"}


async def test_the_agents_endpoints_are_a_micro_service_under_the_deploy_permissions(secured, tmp_path):  # noqa: F811
    sched, agent_c, monitor, operator = [
        await as_user(secured.url, u) for u in ("scheduler", "agent-n1", "monitor", "operator")
    ]
    await bus.ensure_resources(sched.nc)
    engine = Engine(kind="vllm", model="tiny", url="http://127.0.0.1:9")  # nothing answers there: none is loaded
    config = AgentConfig(node="n1", work_dir=tmp_path / "agent", offer_cpu=True, heartbeat_interval=0.25)
    config.engines, config.engine_check_interval = [engine], 3600.0
    stop = asyncio.Event()
    running = asyncio.create_task(Agent(agent_c.nc, config).run(stop))
    try:

        async def info() -> dict | None:
            try:
                reply = await monitor.nc.request(f"$SRV.INFO.{names.AGENT_SERVICE}", b"", timeout=1)
            except Exception:
                return None
            found = msgspec.json.decode(reply.data)
            return found if len(found["endpoints"]) == len(ENDPOINTS) else None

        found = await wait_for(info, timeout=20, interval=0.2, what="the agent's service with its five endpoints")
        assert found["metadata"] == {"node": "n1"}
        subjects = {e["subject"] for e in found["endpoints"]}
        assert subjects == {getattr(names.node("n1"), verb) for verb in ENDPOINTS}, subjects

        # the term fence still stands in front of the handlers: term 5 seen, a command of term 3 is refused
        newer = await bus.request(
            sched.nc, names.node("n1").control, Control(job="j", action="stop", term=5), ControlReply
        )
        assert not newer.ok and "not running" in newer.message, newer
        older = await bus.request(
            sched.nc, names.node("n1").control, Control(job="j", action="stop", term=3), ControlReply
        )
        assert not older.ok and older.message.startswith("deposed"), older

        bad = await operator.nc.request(names.node("n1").reclaim, b'{"device": "zero"}', timeout=5)
        assert bad.headers and bad.headers.get("Nats-Service-Error-Code") == "400", bad.headers
        stats = msgspec.json.decode(
            (await monitor.nc.request(nats_subjects.service_stats(names.AGENT_SERVICE), b"")).data
        )
        counts = {e["name"]: (e["num_requests"], e["num_errors"]) for e in stats["endpoints"]}
        assert counts["agent-control"] == (2, 0) and counts["agent-reclaim"] == (1, 1), counts
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
    for c in (sched, agent_c, monitor, operator):
        assert not c.violations, c.violations
        await c.nc.close()
