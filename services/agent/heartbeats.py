"""What a node says of itself every interval: its devices and who runs on them, its engines' load, its jobs and
which attempt of each. A heartbeat that reached the server (a flush's round trip says so) renews each trainer's
lease (services/agent/trainer_leases.py): a node cut off from the bus, or frozen, lets its trainers go on no longer
than trainer_lease_s, and an attempt whose lease another attempt took over is ended here at once."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import msgspec
from nats.aio.client import Client

from schemas import names
from schemas.jobs import JobId
from schemas.memory import ModelShape
from schemas.nodes import Device, Heartbeat, RunningAttempt
from services import __version__
from services.agent.config import AgentConfig
from services.agent.devices import DeviceProbe
from services.agent.group_run import GroupMember, GroupProcess
from services.agent.job_run import RunningJob
from services.agent.runner import TrainerRun
from services.agent.trainer_leases import TrainerLeases
from services.agent.yielding import Yielder
from services.connection import round_trip
from services.aio import sleep_unless_stopped

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
FINISHED_KEPT_S = 60.0  # how long a finished job stays listed in heartbeats
FLUSH_TIMEOUT_S = 2  # a heartbeat not confirmed by the server within this renews no lease


class Agent(Protocol):
    """What a heartbeat is made of: the agent (services/agent/service.py) as this module reads and keeps it."""

    nc: Client
    cfg: AgentConfig
    probe: DeviceProbe
    yielder: Yielder
    runs: dict[tuple[str, int], RunningJob]
    reclaim: dict[int, int]
    devices: list[Device]
    no_gpu_reason: str
    finished: dict[str, float]
    draining: bool
    models: list[ModelShape]
    confirming: asyncio.Task | None
    last_confirmed: float
    leases: TrainerLeases

    @property
    def jobs(self) -> dict[str, RunningJob]: ...

    async def end_attempt(self, run: RunningJob, why: str, wait_s: float = 0.0) -> bool: ...


def compose(agent: Agent, read: tuple[list[Device], str]) -> Heartbeat:
    """The agent's heartbeat from `read` (what its probe read); the agent keeps the devices as reported."""
    devices, agent.no_gpu_reason = read
    on: dict[int, list[JobId]] = {}
    for run in agent.runs.values():  # an attempt being ended still holds its devices until its trainer is gone
        for index in run.devices:
            on.setdefault(index, []).append(run.assignment.job)
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
        attempts=[
            RunningAttempt(
                job=run.assignment.job,
                attempt=run.attempt,
                devices=run.devices,
                state=run.state,
                group=run.assignment.group,
            )
            for run in agent.runs.values()
            if not run.superseded and not run.final
        ],
        finished=list(agent.finished),
        interval_s=cfg.heartbeat_interval,
        sent_at=now,
        draining=agent.draining,
        models=agent.models,
        engines=agent.yielder.loads(),
    )


async def send(agent: Agent) -> None:
    try:
        read = await agent.probe.read_async()  # NVML may block: its own thread, never behind other work
        sent = time.monotonic()
        await agent.nc.publish(names.node(agent.cfg.node).heartbeat, _enc.encode(compose(agent, read)))
    except Exception as e:  # disconnected: the client buffers and reconnects; the trainers' leases run out
        log.warning("heartbeat not sent: %s", e)
        return
    if agent.confirming is None or agent.confirming.done():  # the next heartbeat never waits for this one's check
        agent.confirming = asyncio.create_task(_renew_when_confirmed(agent, sent))


async def _renew_when_confirmed(agent: Agent, sent: float) -> None:
    """Once the server has the heartbeat (a flush's round trip), the trainers may go on: counted from `sent`. After
    a silence longer than the lease (the node was frozen or cut off) they go on only from the next heartbeat: the
    scheduler has then had one heartbeat to end the attempts it gave away meanwhile, before they compute again."""
    try:
        await round_trip(agent.nc, FLUSH_TIMEOUT_S)
    except Exception as e:  # cut off or stalled: the leases run out and the trainers wait before their next step
        log.warning("heartbeat not confirmed by the server (%s); trainers go on only until their lease ends", e)
        return
    silent = sent - agent.last_confirmed
    agent.last_confirmed = sent
    runs = [run for run in agent.runs.values() if run.trainer and not run.superseded and agent.leases.holds(*run.key)]
    held = await asyncio.gather(*(agent.leases.renew(*run.key, agent.cfg.lease_s) for run in runs))
    for run, kept in zip(runs, held):
        if kept is False:  # before any trainer is let go on (its group's file is not renewed this time)
            await agent.end_attempt(run, "another attempt of the job took over its trainer lease")
    if silent > agent.cfg.lease_s:
        if runs:
            log.warning(
                "this node was not heard for %.1fs: its trainers wait for one more heartbeat, so that the scheduler "
                "can end what it gave to another node meanwhile",
                silent,
            )
        return
    for lease in _leases_kept(runs, held):
        lease.renew(sent)


def _leases_kept(runs: list[RunningJob], held: list[bool | None]) -> list[TrainerRun | GroupProcess]:
    """The lease files that may be renewed: a trainer's when its job's entry was, a co-training group's when every
    member's was (one member's entry not renewed or taken over holds the whole process: it steps for all of them,
    and reads the member's end from its controls once it goes on: trainer/co_train/process.py)."""
    files: dict[int, tuple[TrainerRun | GroupProcess, bool]] = {}
    for run, kept in zip(runs, held):
        lease = run.trainer.group if isinstance(run.trainer, GroupMember) else run.trainer
        assert lease is not None  # the runs listed have one
        files[id(lease)] = (lease, files.get(id(lease), (lease, True))[1] and kept is True)
    return [lease for lease, kept in files.values() if kept]


async def every_interval(agent: Agent, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await send(agent)
        await sleep_unless_stopped(stop, agent.cfg.heartbeat_interval)
