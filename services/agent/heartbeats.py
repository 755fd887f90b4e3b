"""What a node says of itself every interval: its devices and who runs on them, its engines' load, its jobs."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from schemas import names
from schemas.jobs import JobId
from schemas.nodes import Device, Heartbeat
from services import __version__
from services.aio import sleep_unless_stopped

if TYPE_CHECKING:
    from services.agent.service import Agent

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
FINISHED_KEPT_S = 60.0  # how long a finished job stays listed in heartbeats


def compose(agent: Agent, read: tuple[list[Device], str]) -> Heartbeat:
    """The agent's heartbeat from `read` (what its probe read); the agent keeps the devices as reported."""
    devices, agent.no_gpu_reason = read
    on: dict[int, list[JobId]] = {}
    for job_id, run in agent.jobs.items():
        for index in run.devices:
            on.setdefault(index, []).append(job_id)
    agent.devices = devices = [
        msgspec.structs.replace(d, jobs=on.get(d.index, []), reclaim_mib=agent.reclaim.get(d.index, 0)) for d in devices
    ]
    now = time.time()
    agent.finished = {j: t for j, t in agent.finished.items() if now - t < FINISHED_KEPT_S}
    cfg = agent.cfg
    return Heartbeat(
        node=cfg.node,
        agent_version=__version__,
        devices=devices,
        offers_cpu=cfg.offer_cpu,
        no_gpu_reason=agent.no_gpu_reason,
        running=list(agent.jobs),
        finished=list(agent.finished),
        interval_s=cfg.heartbeat_interval,
        sent_at=now,
        draining=agent.draining,
        models=agent.models,
        engines=agent.yielder.loads(),
    )


async def send(agent: Agent) -> None:
    try:
        read = await asyncio.to_thread(agent.probe.read)  # NVML may block: not on the event loop
        await agent.nc.publish(names.node(agent.cfg.node).heartbeat, _enc.encode(compose(agent, read)))
    except Exception as e:  # disconnected: the client buffers and reconnects
        log.warning("heartbeat not sent: %s", e)


async def every_interval(agent: Agent, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await send(agent)
        await sleep_unless_stopped(stop, agent.cfg.heartbeat_interval)
