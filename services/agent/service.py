"""The node agent: heartbeats, takes assignments and controls, follows the registry for its engines (a job's own
life, from fetching its data to shipping its adapter, is in job_run.py)."""

from __future__ import annotations

import asyncio

import logging

import msgspec
import nats.micro
from nats.aio.client import Client
from nats.micro.service import Service

from schemas import names
from schemas.nodes import (
    AssignAccepted,
    AssignRefused,
    Assignment,
    Control,
    ControlReply,
    Device,
    Heartbeat,
    Reclaim,
    ReclaimReply,
)
from services import __version__, bus
from services.aio import cancel_and_wait
from services.agent import heartbeats
from services.agent.assignment_checks import refusal
from services.agent.config import AgentConfig
from services.agent.datasets import DatasetCache
from services.agent.devices import DeviceProbe
from services.agent.models import read_shapes
from services.agent.group_run import GroupProcess
from services.agent.sampler_saves import SamplerSaves
from services.agent.session_run import SessionDesk
from services.agent.job_run import JobLifecycle, RunningJob
from services.agent.deployment import Deployment
from services.agent.term_fence import TermFence
from services.agent.trainer_leases import TrainerLeases
from services.agent.yielding import Yielder, engine_yields
from services.procs import end_leftovers

log = logging.getLogger(__name__)
SHUTDOWN_PUBLISH_S = 5.0  # how long a state published while shutting down is retried (NATS may be gone)
PAUSE_END_S = 6.0  # how long a shutdown waits for paused runs' checkpoints: with the hand-backs (5 s), within 15 s
ATTEMPT_END_S = 10.0  # how long an assignment waits for the attempt it replaces to be gone


class Agent(JobLifecycle):
    """A node's agent: heartbeats its devices, takes assignments and controls, follows the registry for its
    engines; each job runs through JobLifecycle."""

    def __init__(self, nc: Client, config: AgentConfig) -> None:
        names.check_token(config.node, "node id")
        self.nc, self.js, self.cfg = nc, nc.jetstream(), config
        self.probe = DeviceProbe(config.offer_cpu, config.simulate_gpus)
        self.runs: dict[tuple[str, int], RunningJob] = {}  # (job, attempt): one ending while the next is assigned
        self.groups: dict[str, GroupProcess] = {}  # co-training groups' processes here, by group
        self.sessions = SessionDesk(lambda: self.jobs, SamplerSaves(nc, config.node))  # calls for its sessions
        self.confirming: asyncio.Task | None = None  # the check that the last heartbeat reached the server
        self.last_confirmed = float("-inf")  # monotonic: when the last heartbeat the server confirmed was sent
        self.finished: dict[str, float] = {}
        self.draining = False
        self.devices: list[Device] = []
        self.no_gpu_reason = ""
        self.reclaim: dict[int, int] = {}  # device -> MiB its serving engine wants back
        self.datasets = DatasetCache(self.js, config.work_dir / "datasets", config.dataset_cache_mib * 2**20)
        self.models = read_shapes(config.models)
        self.yielder = Yielder(self, engine_yields(config))
        self.terms = TermFence(self.js)  # the newest scheduler term seen: an older one's commands are refused
        self.leases = TrainerLeases(self.js, config.node, lambda: nc.is_connected)  # which attempts may compute

    async def run(self, stop: asyncio.Event) -> None:
        ended = await asyncio.to_thread(end_leftovers, self.cfg.work_dir / "jobs")
        if ended:  # before any device is offered: a trainer of a killed agent may still hold one
            log.warning("ended %d trainer(s) a previous agent left running here: pids %s", len(ended), ended)
        self.devices, self.no_gpu_reason = await self.probe.read_async()
        await self.leases.open()
        if not self.devices:
            log.warning("node %s has no device to offer: %s", self.cfg.node, self.no_gpu_reason)
        on_assign = bus.handler(
            self._on_assign,
            Assignment,
            invalid=lambda errors: AssignRefused(None, f"the assignment did not decode: {errors[0].reason}"),
        )
        on_control = bus.handler(
            self._on_control,
            Control,
            invalid=lambda errors: ControlReply(None, False, f"did not decode: {errors[0].reason}"),
        )
        on_reclaim = bus.handler(self._on_reclaim, Reclaim)
        service = await nats.micro.add_service(
            self.nc,
            name=names.AGENT_SERVICE,
            version=__version__,
            description=f"jetlora node agent of {self.cfg.node}",
            metadata={"node": self.cfg.node},
        )
        group = service.add_group(name=names.node_group(self.cfg.node))
        for verb, answer in (
            ("assign", on_assign),
            ("control", on_control),
            ("reclaim", on_reclaim),
            ("session", self.sessions.on_message),  # each call in a task of its own (SessionDesk)
        ):
            await bus.add_endpoint(group, f"agent-{verb}", answer, verb)
        await self.nc.flush()
        log.info("agent %s up with %d device(s)", self.cfg.node, len(self.devices))
        beat = asyncio.create_task(heartbeats.every_interval(self, stop))
        deployment = asyncio.create_task(
            Deployment(
                self.nc,
                self.cfg.node,
                self.cfg.engines,
                self.cfg.work_dir,
                self.cfg.engine_check_interval,
                self.cfg.stage_adapters,
                self.cfg.adapter_cache_mib * 2**20,
                self.cfg.grader_env,
            ).run(stop, serving=group)
        )
        yielding = asyncio.create_task(self.yielder.run(stop))
        await stop.wait()
        await cancel_and_wait([deployment, yielding])
        await self._shutdown(service, beat)

    async def _shutdown(self, service: Service, beat: asyncio.Task) -> None:
        """SIGTERM: stop taking work, hand running jobs back to the scheduler, stop heartbeating."""
        self.draining = True
        try:
            await service.stop()  # no new requests; the jobs are handed back below even if NATS is away
        except Exception as e:
            log.warning("shutting down: the agent's endpoints could not be closed (%s: %s)", type(e).__name__, e)
        await self.sessions.close()
        await self._let_pauses_end()  # before the kills: a killed run given an await would report itself cancelled
        runs = [run for run in self.runs.values() if not run.superseded]
        ending = [run for run in runs if not run.final]  # one that said how it ended stays so
        for run in ending:
            log.warning(
                "shutting down: %s job %s",
                "ending the cancelled" if run.cancel_asked else "handing back to the scheduler",
                run.assignment.job,
            )
            if run.trainer:
                run.trainer.cancel()
        await cancel_and_wait([run.task for run in runs] + [run.checkpoint_upload for run in runs])
        await asyncio.gather(*(self._hand_back(run) for run in ending))  # each within SHUTDOWN_PUBLISH_S
        await self._beat()  # one last heartbeat that says we are draining
        await cancel_and_wait([beat, self.confirming])
        self.probe.close()

    async def _let_pauses_end(self) -> None:
        """Runs whose trainers ended in a pause are no longer running: their checkpoints are given PAUSE_END_S to
        be stored and the pause reported, rather than handed back as lost."""
        pausing = [run.task for run in self.runs.values() if run.pausing and not run.superseded and run.task]
        if pausing:
            log.warning(
                "shutting down: %d job(s) paused here; up to %.0f s for their checkpoints to be stored and said",
                len(pausing),
                PAUSE_END_S,
            )
            await asyncio.wait(pausing, timeout=PAUSE_END_S)

    async def _hand_back(self, run: RunningJob) -> None:
        """What a shutdown says of a run that had not said how it ended: the ending it was saying (a pause whose
        checkpoint is stored), sent again under the same id so JetStream keeps one; else cancelled or queued."""
        node, closing = self.cfg.node, run.closing
        try:
            if closing is not None:
                await bus.publish_durably(self.js, *closing, give_up_after=SHUTDOWN_PUBLISH_S)
            elif run.cancel_asked:  # cancelled a moment before: it stays cancelled
                await self._report(run, "cancelled", "cancelled", give_up_after=SHUTDOWN_PUBLISH_S)
            else:
                words = f"node {node} shut down while the job ran; handed back to the queue"
                if run.pausing:
                    words = f"node {node} shut down before the job's pause stored its checkpoint; handed back as a loss"
                await self._report(run, "queued", words, give_up_after=SHUTDOWN_PUBLISH_S)
        except Exception as e:  # NATS is gone: the scheduler re-queues it once this node's heartbeats stop
            log.warning(
                "job %s: could not say %s (%s); the scheduler will re-queue it when this node's heartbeats stop",
                run.assignment.job,
                "how its attempt ended" if closing is not None else "it was handed back",
                type(e).__name__,
            )

    # --- heartbeats (services/agent/heartbeats.py) ---------------------------------------------------
    def heartbeat(self, read: tuple[list[Device], str] | None = None) -> Heartbeat:
        """This node's heartbeat, from `read` (what probe.read() returned) or a fresh read."""
        return heartbeats.compose(self, read or self.probe.read())

    async def _beat(self) -> None:
        await heartbeats.send(self)

    # --- runs -------------------------------------------------------------------------------------
    @property
    def jobs(self) -> dict[str, RunningJob]:
        """The job's current attempt here, by job (attempts the scheduler ended are left out)."""
        return {run.assignment.job: run for run in self.runs.values() if not run.superseded}

    async def end_attempt(self, run: RunningJob, why: str, wait_s: float = 0.0) -> bool:
        """End an attempt the scheduler no longer counts on: kill its trainer, report and store nothing more.
        With `wait_s`, wait that long for it to be gone; whether it is."""
        if not run.superseded:
            log.warning("ending attempt %d of job %s: %s", run.attempt, run.assignment.job, why)
        run.superseded = why
        if run.trainer:
            run.trainer.cancel()
        if run.task and not run.task.done():
            run.task.cancel()
            if wait_s:
                await asyncio.wait([run.task], timeout=wait_s)
        return run.key not in self.runs

    # --- assignments -----------------------------------------------------------------------------
    async def _on_assign(self, a: Assignment) -> AssignAccepted | AssignRefused:
        if refused := await self.terms.refusal(a.term, f"attempt {a.attempt} of job {a.job}"):
            return AssignRefused(a.job, refused)
        for run in [r for r in self.runs.values() if r.assignment.job == a.job]:
            if run.attempt == a.attempt and not run.superseded:
                return AssignAccepted(a.job)  # a repeated assignment of what we already run: accept again
            if run.attempt > a.attempt:
                return AssignRefused(a.job, f"this node runs attempt {run.attempt} of the job, newer than {a.attempt}")
            if not await self.end_attempt(run, f"attempt {a.attempt} replaces it", wait_s=ATTEMPT_END_S):
                return AssignRefused(a.job, f"attempt {run.attempt} of the job is still ending here; try again")
        self.devices, _ = await self.probe.read_async()  # NVML may block: its own thread
        busy = {key: run.devices for key, run in self.runs.items() if not _same_group(a, run)}
        if a.need_mib is not None and not any(_same_group(a, run) for run in self.runs.values()):
            a = msgspec.structs.replace(a, need_mib=None)  # no process of its group here yet: it needs all of it
        reason = refusal(a, self.devices, busy, self.reclaim, self.draining)
        if reason:
            return AssignRefused(a.job, reason)
        run = RunningJob(a, a.ranks)
        self.runs[run.key] = run
        run.task = asyncio.create_task(self._run_job(run))
        return AssignAccepted(a.job)

    async def _on_control(self, c: Control) -> ControlReply:
        if refused := await self.terms.refusal(c.term, f"{c.action} of job {c.job}"):
            return ControlReply(c.job, False, refused)
        if c.action == "end":
            ended = [r for r in self.runs.values() if r.assignment.job == c.job and c.attempt in (0, r.attempt)]
            for each in ended:
                await self.end_attempt(each, c.by or "the scheduler ended it")
            what = ", ".join(str(r.attempt) for r in ended)
            return ControlReply(c.job, True, f"ended attempt {what}" if ended else "no such attempt runs here")
        run = self.jobs.get(c.job)
        if run is None:
            return ControlReply(c.job, False, f"job {c.job} is not running on {self.cfg.node}")
        if c.attempt and c.attempt != run.attempt:
            return ControlReply(
                c.job, False, f"{self.cfg.node} runs attempt {run.attempt} of job {c.job}, not attempt {c.attempt}"
            )
        log.info(
            "%s asked for job %s (attempt %d): its trainer %s",
            c.action,
            c.job,
            run.assignment.attempt,
            "has not started" if run.trainer is None or run.trainer.proc is None else "runs",
        )
        if c.action == "cancel":
            run.cancel_asked = True
            if run.trainer:
                run.trainer.cancel()
            elif run.task:
                run.task.cancel()
            self.leases.give_up(*run.key)  # waiting for another attempt's trainer lease: cancelled now, not then
        elif c.action == "pause":
            await self.yielder.release(run)  # a stopped trainer must compute to reach its checkpoint
            run.paused_by = c.by or "user"
            if run.trainer:
                run.trainer.pause()
            self.leases.give_up(*run.key)  # waiting for another attempt's trainer lease: paused now, not then
        else:
            await self.yielder.release(run)
            run.stop_asked = True
            if run.trainer:
                run.trainer.stop()
        return ControlReply(c.job, True, f"{c.action} sent")

    async def _on_reclaim(self, r: Reclaim) -> ReclaimReply:
        """A serving engine wants its device's memory back (or no longer does): heartbeats say so, and the
        scheduler pauses the job there if its priority allows."""
        if all(d.index != r.device for d in self.devices):
            return ReclaimReply(False, f"no device {r.device} on node {self.cfg.node}")
        if r.mib:
            self.reclaim[r.device] = r.mib
        else:
            self.reclaim.pop(r.device, None)
        await self._beat()
        held = [j for j, run in self.jobs.items() if r.device in run.devices]
        return ReclaimReply(
            True, f"device {r.device}: {r.mib} MiB wanted back" + (f"; job {held[0]} runs there" if held else "")
        )

    async def reclaim_device(self, device: int, mib: int) -> None:
        """An engine here wants a device's memory back (or lets go of it): as if it had asked on the bus."""
        await self._on_reclaim(Reclaim(device=device, mib=mib))


def _same_group(a: Assignment, run: RunningJob) -> bool:
    """Whether `a` joins the co-training group `run` trains in, on the same device: it shares that device."""
    return a.group is not None and run.assignment.group == a.group and run.devices == a.ranks
