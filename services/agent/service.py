"""The node agent: heartbeats, takes assignments, runs each job's trainer, reports states, ships artifacts."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from nats.aio.client import Client

from schemas import names
from schemas.events import (
    Cancelled,
    Checkpoint,
    DataFile,
    Failed,
    Finished,
    Preparing,
    Progress,
    Samples,
    Started,
    StateChange,
    TrainerSpec,
)
from schemas.jobs import ArtifactRef, CheckpointInfo, DatasetRef, JobState
from schemas.nodes import (
    CPU_DEVICE,
    AssignAccepted,
    AssignRefused,
    Assignment,
    Control,
    ControlReply,
    Device,
    Heartbeat,
    Reclaim,
    ReclaimReply,
    on_devices,
)
from services import bus
from services.aio import cancel_and_wait
from services.agent import heartbeats
from services.agent.admission import refusal
from services.agent.datasets import DatasetCache, DatasetUnavailable, LocalDataset
from services.agent.devices import DeviceProbe
from services.agent.engines import Engine
from services.agent.models import read_shapes
from services.agent.rollout import CHECK_INTERVAL_S, Rollout
from services.agent.runner import DEFAULT_TRAINER, TrainerRun
from services.agent.shipping import fetch_adapter, fetch_checkpoint, ship_checkpoint, ship_results
from services.agent.yielding import Yielded, Yielder, YieldPolicy, engine_yields
from services.artifacts.sender import UploadError
from services.procs import end_leftovers

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
SHUTDOWN_PUBLISH_S = 5.0  # how long a state published while shutting down is retried (NATS may be gone)


@dataclass
class AgentConfig:
    node: str
    work_dir: Path
    heartbeat_interval: float = 1.0
    offer_cpu: bool = False
    simulate_gpus: str | None = None
    trainer_command: list[str] = field(default_factory=lambda: list(DEFAULT_TRAINER))
    keep_job_dirs: bool = False
    dataset_cache_mib: int = 20480  # datasets (and their tokenized copies) kept for the next job
    engines: list[Engine] = field(default_factory=list)  # serving engines here: they load the registry's adapters
    models: list[str] = field(default_factory=list)  # base model directories here, advertised with their shapes
    engine_yield: list[YieldPolicy] = field(default_factory=list)  # per engine (one: for all); none: YieldPolicy()
    engine_check_interval: float = CHECK_INTERVAL_S  # how often what each engine serves is compared with the registry
    stage_adapters: bool = True  # fetch a new version of a served adapter when it is registered, before its promotion


@dataclass
class RunningJob:
    assignment: Assignment
    devices: list[int]  # one rank on each, rank 0's first
    task: asyncio.Task | None = None
    trainer: TrainerRun | None = None
    stop_asked: bool = False
    cancel_asked: bool = False  # a cancel came: shutting down now must not hand the job back to the queue
    paused_by: str | None = None  # a pause was asked, by this ("user", or a serving engine)
    last_progress: Progress | None = None
    checkpoint_upload: asyncio.Task | None = None
    datasets: list[LocalDataset] = field(default_factory=list)  # held in the cache until the job ends
    reports: int = 0  # numbers this run's state events, so JetStream's de-duplication keys each one apart
    yielded: Yielded = field(default_factory=Yielded)  # how it stands with the serving engines beside it


class Agent:
    def __init__(self, nc: Client, config: AgentConfig) -> None:
        names.check_token(config.node, "node id")
        self.nc, self.js, self.cfg = nc, nc.jetstream(), config
        self.probe = DeviceProbe(config.offer_cpu, config.simulate_gpus)
        self.jobs: dict[str, RunningJob] = {}
        self.finished: dict[str, float] = {}
        self.draining = False
        self.devices: list[Device] = []
        self.no_gpu_reason = ""
        self.reclaim: dict[int, int] = {}  # device -> MiB its serving engine wants back
        self.datasets = DatasetCache(self.js, config.work_dir / "datasets", config.dataset_cache_mib * 2**20)
        self.models = read_shapes(config.models)
        self.yielder = Yielder(self, engine_yields(config))

    async def run(self, stop: asyncio.Event) -> None:
        ended = await asyncio.to_thread(end_leftovers, self.cfg.work_dir / "jobs")
        if ended:  # before any device is offered: a trainer of a killed agent may still hold one
            log.warning("ended %d trainer(s) a previous agent left running here: pids %s", len(ended), ended)
        self.devices, self.no_gpu_reason = self.probe.read()
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
        subjects = names.node(self.cfg.node)
        subs = [
            await self.nc.subscribe(subjects.assign, cb=on_assign),
            await self.nc.subscribe(subjects.control, cb=on_control),
            await self.nc.subscribe(subjects.reclaim, cb=on_reclaim),
        ]
        await self.nc.flush()
        log.info("agent %s up with %d device(s)", self.cfg.node, len(self.devices))
        beat = asyncio.create_task(heartbeats.every_interval(self, stop))
        rollout = asyncio.create_task(
            Rollout(
                self.nc,
                self.cfg.node,
                self.cfg.engines,
                self.cfg.work_dir,
                self.cfg.engine_check_interval,
                self.cfg.stage_adapters,
            ).run(stop)
        )
        yielding = asyncio.create_task(self.yielder.run(stop))
        await stop.wait()
        await cancel_and_wait([rollout, yielding])
        await self._shutdown(subs, beat)

    async def _shutdown(self, subs, beat: asyncio.Task) -> None:
        """SIGTERM: stop taking work, hand running jobs back to the scheduler, stop heartbeating."""
        self.draining = True
        for sub in subs:
            await sub.unsubscribe()
        runs = list(self.jobs.values())
        for run in runs:
            log.warning(
                "shutting down: %s job %s",
                "ending the cancelled" if run.cancel_asked else "handing back to the scheduler",
                run.assignment.job,
            )
            if run.trainer:
                run.trainer.cancel()
        await cancel_and_wait([run.task for run in runs] + [run.checkpoint_upload for run in runs])
        for run in runs:
            try:
                if run.cancel_asked:  # cancelled a moment before: it stays cancelled
                    await self._report(run, "cancelled", "cancelled", give_up_after=SHUTDOWN_PUBLISH_S)
                    continue
                await self._report(
                    run,
                    "queued",
                    f"node {self.cfg.node} shut down while the job ran; handed back to the queue",
                    give_up_after=SHUTDOWN_PUBLISH_S,
                )
            except Exception as e:  # NATS is gone: the scheduler re-queues it once this node's heartbeats stop
                log.warning(
                    "job %s: could not say it was handed back (%s); the scheduler will re-queue it when this "
                    "node's heartbeats stop",
                    run.assignment.job,
                    type(e).__name__,
                )
        await self._beat()  # one last heartbeat that says we are draining
        await cancel_and_wait([beat])

    # --- heartbeats (services/agent/heartbeats.py) ---------------------------------------------------
    def heartbeat(self, read: tuple[list[Device], str] | None = None) -> Heartbeat:
        """This node's heartbeat, from `read` (what probe.read() returned) or a fresh read."""
        return heartbeats.compose(self, read or self.probe.read())

    async def _beat(self) -> None:
        await heartbeats.send(self)

    # --- assignments -----------------------------------------------------------------------------
    async def _on_assign(self, a: Assignment) -> AssignAccepted | AssignRefused:
        self.devices, _ = await asyncio.to_thread(self.probe.read)  # NVML may block: not on the event loop
        reason = refusal(a, self.devices, {j: r.devices for j, r in self.jobs.items()}, self.reclaim, self.draining)
        if reason:
            return AssignRefused(a.job, reason)
        if a.job not in self.jobs:
            run = RunningJob(a, a.ranks)
            self.jobs[a.job] = run
            run.task = asyncio.create_task(self._run_job(run))
        return AssignAccepted(a.job)

    async def _on_control(self, c: Control) -> ControlReply:
        run = self.jobs.get(c.job)
        if run is None:
            return ControlReply(c.job, False, f"job {c.job} is not running on {self.cfg.node}")
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
        elif c.action == "pause":
            await self.yielder.release(run)  # a stopped trainer must compute to reach its checkpoint
            run.paused_by = c.by or "user"
            if run.trainer:
                run.trainer.pause()
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

    async def report_yield(self, run: RunningJob, message: str) -> None:
        await self._report(run, "running", message)

    # --- one job --------------------------------------------------------------------------------
    def _subjects(self, a: Assignment) -> names.JobSubjects:
        """Where this node reports the job's events: under the job's tenant, so its users can follow them."""
        return names.job(a.job, self.cfg.node, names.tenant_token(a.tenant))

    async def _report(
        self,
        run: RunningJob,
        state: JobState,
        message: str,
        artifacts: list[ArtifactRef] | None = None,
        paused_by: str | None = None,
        checkpoint: CheckpointInfo | None = None,
        give_up_after: float = 300.0,
    ) -> None:
        a = run.assignment
        ev = StateChange(
            job=a.job,
            state=state,
            node=self.cfg.node,
            attempt=a.attempt,
            message=message,
            artifacts=artifacts or [],
            ts=time.time(),
            paused_by=paused_by,
            checkpoint=checkpoint,
        )
        run.reports += 1
        await bus.publish_durably(
            self.js,
            self._subjects(a).state,
            _enc.encode(ev),
            f"{a.job}.{a.attempt}.s{run.reports}",
            give_up_after=give_up_after,
        )

    async def _progress(self, run: RunningJob, p: Progress) -> None:
        a = run.assignment
        run.last_progress = p
        p = msgspec.structs.replace(p, job=a.job, ts=p.ts or time.time())
        await bus.publish_durably(self.js, self._subjects(a).progress, _enc.encode(p), f"{a.job}.{a.attempt}.p{p.step}")

    async def _run_job(self, run: RunningJob) -> None:
        a = run.assignment
        job_dir = self.cfg.work_dir / "jobs" / f"{a.job}-{a.attempt}"
        try:
            await self._report(run, "preparing", f"starting the trainer on {self.cfg.node} {on_devices(run.devices)}")
            result = await self._train(run, job_dir)
            if run.checkpoint_upload:  # its state event must not come after the job's end
                await run.checkpoint_upload
            if isinstance(result, (Failed, Cancelled)):
                await self._report(
                    run,
                    "cancelled" if isinstance(result, Cancelled) else "failed",
                    result.message + run.yielded.summary(),
                )
                return
            if result.state == "paused":
                await self._report(
                    run,
                    "paused",
                    (result.message or f"paused at step {result.step}") + run.yielded.summary(),
                    paused_by=run.paused_by or "user",
                )
                return
            await self._report(run, "uploading", f"{result.message or 'trained'}; storing the artifacts")
            artifacts = await ship_results(self.nc, self.cfg.node, a, result, job_dir / "out")
            final: JobState = "stopped" if result.state == "stopped" else "succeeded"
            stored = ", ".join(r.name for r in artifacts)
            await self._report(
                run, final, f"{result.message or result.state}; stored {stored}{run.yielded.summary()}", artifacts
            )
        except asyncio.CancelledError:
            if run.paused_by and not self.draining:
                await self._report(run, "paused", "paused before the trainer started", paused_by=run.paused_by)
            elif not self.draining:
                await self._report(run, "cancelled", "cancelled before the trainer started")
        except (UploadError, DatasetUnavailable) as e:
            await self._report(run, "failed", str(e))
        except Exception as e:
            log.exception("job %s failed in the agent", a.job)
            await self._report(run, "failed", f"the agent failed running the job: {e!r}")
        finally:
            for local in run.datasets:
                self.datasets.release(local)
            self.jobs.pop(a.job, None)
            self.finished[a.job] = time.time()
            if not self.cfg.keep_job_dirs:
                shutil.rmtree(job_dir, ignore_errors=True)

    async def _train(self, run: RunningJob, job_dir: Path) -> Finished | Failed | Cancelled:
        a = run.assignment
        gpu = a.device != CPU_DEVICE
        env = {
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, run.devices)) if gpu else "",
        }
        if len(run.devices) > 1 and "OMP_NUM_THREADS" not in os.environ:  # ranks share the node's cores
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(run.devices)))
        spec = TrainerSpec(
            job=a.job,
            attempt=a.attempt,
            request=a.request,
            out_dir=str(job_dir / "out"),
            device="cuda" if gpu else "cpu",
            resume_from=await self._fetch_checkpoint(run, job_dir),
            dataset=await self._fetch_dataset(run, a.request.dataset),
            validation=await self._fetch_dataset(run, a.request.validation_dataset),
            token_cache=str(self.datasets.tokens),
            init_adapter=await self._fetch_init_adapter(run, job_dir),
        )
        run.trainer = TrainerRun(
            spec,
            job_dir,
            self.cfg.trainer_command,
            env,
            ranks=len(run.devices),
            niceness=self.yielder.niceness(run.devices),
        )
        if run.cancel_asked:  # asked while this task was cancelled at an await that can swallow it (3.11's wait_for)
            run.trainer.cancel()
        if run.stop_asked:
            run.trainer.stop()
        if run.paused_by:
            run.trainer.pause()

        async def on_event(ev) -> None:
            if isinstance(ev, Started):
                await self._report(run, "running", ev.message or f"training {ev.steps} steps on {ev.device}")
            elif isinstance(ev, Progress):
                await self._progress(run, ev)
            elif isinstance(ev, Preparing):
                p = msgspec.structs.replace(ev, job=a.job, ts=ev.ts or time.time())
                await bus.publish_durably(
                    self.js, self._subjects(a).preparing, _enc.encode(p), f"{a.job}.{a.attempt}.d{ev.done}"
                )
            elif isinstance(ev, Samples):
                samples = msgspec.structs.replace(ev, job=a.job, ts=ev.ts or time.time())
                await bus.publish_durably(
                    self.js,
                    self._subjects(a).samples,
                    _enc.encode(samples),
                    f"{a.job}.{a.attempt}.x{ev.step}{ev.model}",
                )
            elif isinstance(ev, Checkpoint):
                if run.paused_by and run.checkpoint_upload:  # the pause's checkpoint is what resume needs
                    await run.checkpoint_upload
                if run.checkpoint_upload and not run.checkpoint_upload.done():
                    log.info(
                        "job %s: checkpoint at step %d skipped, the previous one is still uploading", a.job, ev.step
                    )
                else:
                    run.checkpoint_upload = asyncio.create_task(self._ship_checkpoint(run, ev))

        return await run.trainer.run(on_event)

    async def _fetch_dataset(self, run: RunningJob, ref: DatasetRef | None) -> DataFile | None:
        """The job's dataset on local disk, from this node's cache or fetched into it."""
        if ref is None:
            return None
        await self._report(run, "preparing", f"fetching dataset {ref.name}")
        local = await self.datasets.acquire(ref)
        run.datasets.append(local)
        return DataFile(
            path=str(local.path), sha256=local.info.sha256, format=local.info.stats.format, rows=local.info.stats.rows
        )

    async def _fetch_checkpoint(self, run: RunningJob, job_dir: Path) -> str | None:
        """A re-queued or resumed job goes on from the checkpoint its last node stored; None: from step 0."""
        a = run.assignment
        if not a.resume_from:
            return None
        try:
            where = await fetch_checkpoint(self.nc, a, job_dir)
        except Exception as e:
            log.warning(
                "job %s: checkpoint %s could not be fetched (%s); starting from step 0", a.job, a.resume_from, e
            )
            await self._report(
                run, "preparing", f"checkpoint {a.resume_from} could not be fetched ({e}); starting from step 0"
            )
            return None
        await self._report(run, "preparing", f"resuming from checkpoint {a.resume_from}")
        return str(where)

    async def _fetch_init_adapter(self, run: RunningJob, job_dir: Path) -> str | None:
        """The registered adapter the job starts from, unpacked into its directory."""
        ref = run.assignment.request.init_adapter
        if ref is None or ref.peft is None:
            return None
        await self._report(run, "preparing", f"starting from adapter {ref.name}@{ref.version}")
        return str(await fetch_adapter(self.nc, ref.peft, job_dir))

    async def _ship_checkpoint(self, run: RunningJob, ev: Checkpoint) -> None:
        """Checkpoints go to the object store as they come, so another node can resume if this one goes."""
        try:
            info = await ship_checkpoint(self.nc, self.cfg.node, run.assignment, ev, run.last_progress)
            await self._report(run, "running", f"checkpoint at step {ev.step} stored", checkpoint=info)
        except Exception as e:
            log.warning("job %s: checkpoint at step %d not stored: %s", run.assignment.job, ev.step, e)
