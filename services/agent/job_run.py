"""One job on this node, from its assignment to its last state: its trainer (once what it needs is fetched:
job_inputs.py, and its trainer lease is held: trainer_leases.py), its events and reports, its checkpoints and
artifacts shipped."""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client

from schemas import names
from schemas.events import (
    Cancelled,
    Checkpoint,
    Failed,
    Finished,
    Preparing,
    Progress,
    Requeue,
    Samples,
    Started,
    StateChange,
)
from schemas.job_status import ACTIVE_STATES, ArtifactRef, CheckpointInfo, JobState
from schemas.nodes import Assignment, on_devices
from schemas.trainer_lease import Holder
from services import bus
from services.agent.config import AgentConfig
from services.agent.datasets import DatasetCache, DatasetUnavailable, LocalDataset
from services.agent.job_inputs import JobInputs
from services.agent.group_run import GroupMember, GroupProcess
from services.agent.pause_ending import Shipped, is_pause, lost_pause, read_pause
from services.agent.session_run import SessionLost, SessionRun, TakesCalls
from services.agent.runner import TrainerRun, trainer_env
from services.agent.trainer_leases import Superseded, TrainerLeases, waiting_words
from services.agent.shipping import ship_checkpoint, ship_results
from services.agent.yielding import Yielded, Yielder
from services.transfer.sender import UploadError

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()


@dataclass
class RunningJob:
    """A job this node runs: its assignment, what was asked of it since, and how it stands."""

    assignment: Assignment
    devices: list[int]  # one rank on each, rank 0's first
    task: asyncio.Task | None = None
    trainer: TrainerRun | GroupMember | None = None
    stop_asked: bool = False
    cancel_asked: bool = False  # a cancel came: shutting down now must not hand the job back to the queue
    paused_by: str | None = None  # a pause was asked, by this ("user", or a serving engine)
    last_progress: Progress | None = None
    checkpoint_upload: asyncio.Task | None = None
    datasets: list[LocalDataset] = field(default_factory=list)  # held in the cache until the job ends
    reports: int = 0  # numbers this run's state events, so JetStream's de-duplication keys each one apart
    yielded: Yielded = field(default_factory=Yielded)  # how it stands with the serving engines beside it
    state: JobState = "preparing"  # as last reported: what heartbeats say of this attempt
    final: bool = False  # its last state is reported: heartbeats no longer list it as running
    superseded: str = ""  # why the scheduler ended this attempt: it reports and stores nothing more
    shipped: Shipped | None = None  # the trainer's latest checkpoint, and how its trip to the object store went
    newest: CheckpointInfo | None = None  # the newest checkpoint this attempt stored
    ended: Finished | Failed | Cancelled | Requeue | None = None  # what its trainer ended with
    closing: tuple[str, bytes, str] | None = None  # its last state on its way: (subject, event, JetStream msg id)

    @property
    def key(self) -> tuple[str, int]:
        """How the agent holds it: one job may have an attempt ending while the next is assigned."""
        return self.assignment.job, self.assignment.attempt

    @property
    def attempt(self) -> int:
        return self.assignment.attempt

    @property
    def pausing(self) -> bool:
        """Its trainer ended in a pause whose checkpoint and report are still on their way: no longer running."""
        return is_pause(self.ended) and not self.final


class JobLifecycle:
    """The agent's part that runs each job (the Agent holds the attributes below)."""

    nc: Client
    js: Any
    cfg: AgentConfig
    datasets: DatasetCache
    yielder: Yielder
    runs: dict[tuple[str, int], RunningJob]
    groups: dict[str, GroupProcess]
    finished: dict[str, float]
    draining: bool
    leases: TrainerLeases

    async def report_yield(self, run: RunningJob, message: str) -> None:
        await self._report(run, "running", message)

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
        train_alone: str = "",
    ) -> None:
        a = run.assignment
        if run.superseded:  # not the job's attempt any more: its word would only be ignored
            log.info("job %s attempt %d: not reporting %s (%s)", a.job, a.attempt, state, run.superseded)
            return
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
            train_alone=train_alone,
        )
        run.reports += 1
        sending = (self._subjects(a).state, _enc.encode(ev), f"{a.job}.{a.attempt}.s{run.reports}")
        if state not in ACTIVE_STATES:  # a shutdown meanwhile sends these words again, never others (Agent)
            run.closing = sending
        await bus.publish_durably(self.js, *sending, give_up_after=give_up_after)
        if state in ("preparing", "running", "uploading"):
            run.state = state
        else:
            run.final = True

    async def _progress(self, run: RunningJob, p: Progress) -> None:
        a = run.assignment
        run.last_progress = p
        if run.superseded:
            return
        p = msgspec.structs.replace(p, job=a.job, ts=p.ts or time.time())
        await bus.publish_durably(self.js, self._subjects(a).progress, _enc.encode(p), f"{a.job}.{a.attempt}.p{p.step}")

    async def _run_job(self, run: RunningJob) -> None:
        a = run.assignment
        job_dir = self.cfg.work_dir / "jobs" / f"{a.job}-{a.attempt}"
        try:
            await self._report(run, "preparing", f"starting the trainer on {self.cfg.node} {on_devices(run.devices)}")
            result = await self._trained(run, job_dir)
            if run.checkpoint_upload:  # its state event must not come after the job's end
                await run.checkpoint_upload
            if isinstance(result, Requeue):  # split out of its co-training group: its checkpoint in the same write
                shipped = Shipped(result.step)
                if result.checkpoint:
                    await self._store_checkpoint(run, Checkpoint(step=result.step, path=result.checkpoint), shipped)
                words = result.message + run.yielded.summary()
                await self._report(run, "queued", words, train_alone=result.message, checkpoint=shipped.info)
                return
            if isinstance(result, (Failed, Cancelled)):
                await self._report(
                    run,
                    "cancelled" if isinstance(result, Cancelled) else "failed",
                    result.message + run.yielded.summary(),
                )
                return
            if result.state == "paused":
                await self._end_paused(run, result)
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
        except (UploadError, DatasetUnavailable, SessionLost) as e:
            await self._report(run, "failed", str(e))
        except Exception as e:
            log.exception("job %s failed in the agent", a.job)
            await self._report(run, "failed", f"the agent failed running the job: {e!r}")
        finally:
            if isinstance(run.trainer, GroupMember) and run.trainer.left_unconfirmed:
                self.leases.forget(*run.key)  # its group may still compute it: the job's next attempt waits it out
            else:
                await self.leases.release(*run.key)  # its trainer is gone: the job's next attempt need not wait
            for local in run.datasets:
                self.datasets.release(local)
            if not run.superseded:
                self.finished[a.job] = time.time()
            self.runs.pop(run.key, None)
            if not self.cfg.keep_job_dirs:  # a job's directory may be large: not on the loop heartbeats share
                await asyncio.shield(asyncio.to_thread(shutil.rmtree, job_dir, ignore_errors=True))

    async def _trained(self, run: RunningJob, job_dir: Path) -> Finished | Failed | Cancelled | Requeue:
        """_train, and what it ended with kept: the trainer says nothing more after it."""
        try:
            run.ended = await self._train(run, job_dir)
            return run.ended
        finally:
            if run.shipped:
                run.shipped.followed.set()

    async def _end_paused(self, run: RunningJob, result: Finished) -> None:
        """Paused, naming its checkpoint, once the checkpoint the trainer took as it paused is stored whole; else
        handed back as a loss, saying why (pause_ending.py)."""
        kept = run.shipped.kept(result) if run.shipped else None
        if kept is None:
            words = lost_pause(run.assignment, result, run.shipped, run.newest)
            await self._report(run, "queued", words + run.yielded.summary())
            return
        words = (result.message or f"paused at step {result.step}") + run.yielded.summary()
        await self._report(run, "paused", words, paused_by=run.paused_by or "user", checkpoint=kept)

    async def _train(self, run: RunningJob, job_dir: Path) -> Finished | Failed | Cancelled | Requeue:
        """Fetch what the job needs, run its trainer to its end (what was asked of the job meanwhile passed on to
        it), its events reported as they come."""
        say = functools.partial(self._report, run, "preparing")
        spec = await JobInputs(self.nc, self.cfg, self.datasets, run.assignment, job_dir, say, run.datasets).spec()
        if run.assignment.group:  # co-trained: it joins its group's process (started for the first job)
            run.trainer = self._group_of(run).member(spec)
        else:
            kind = SessionRun if run.assignment.request.train.method == "session" else TrainerRun
            run.trainer = kind(
                spec,
                job_dir,
                self.cfg.trainer_command,
                {**trainer_env(run.assignment.device, run.devices), **self.cfg.grader_env},
                ranks=len(run.devices),
                niceness=self.yielder.niceness(run.devices),
                lease_s=self.cfg.lease_s,
            )
        if isinstance(run.trainer, TrainerRun):  # each line it prints after a checkpoint settles what that one was
            run.trainer.said_more = lambda: run.shipped.followed.set() if run.shipped else None
        if run.stop_asked:
            run.trainer.stop()
        try:  # a cancel or pause meanwhile gives the wait up (Agent._on_control): CancelledError, reported as asked
            if run.cancel_asked or run.paused_by:  # asked before its trainer was made: ended now, nothing waited for
                raise asyncio.CancelledError  # (or a cancel swallowed by an await: 3.11's wait_for)
            run.trainer.lease_from = await self.leases.take(
                run.assignment.job, run.attempt, self.cfg.lease_s, functools.partial(self._waiting_for, run)
            )
        except Superseded as e:  # the scheduler ends this attempt too: nothing to report
            log.warning("job %s attempt %d does not start: %s", run.assignment.job, run.attempt, e)
            run.superseded = str(e)
            return Cancelled(message=str(e))
        return await run.trainer.run(functools.partial(self._on_trainer_event, run))

    async def _waiting_for(self, run: RunningJob, other: Holder) -> None:
        """The job's trainer lease is another attempt's: its trainer may still compute, so this one waits."""
        log.warning("job %s attempt %d: %s", run.assignment.job, run.attempt, waiting_words(other))
        await self._report(run, "preparing", waiting_words(other))

    def _group_of(self, run: RunningJob) -> GroupProcess:
        """The co-training group the job joins: the one running here, or a new one it starts."""
        name = run.assignment.group
        assert name is not None, "only a co-trained job has a group"
        group = self.groups.get(name)
        if group is None or group.closing:

            def forget(ended: GroupProcess) -> None:
                if self.groups.get(ended.name) is ended:
                    del self.groups[ended.name]

            group = GroupProcess(
                name,
                self.cfg.work_dir / "jobs" / f"group-{name}-{run.assignment.job}-{run.attempt}",
                self.cfg.group_command,
                {**trainer_env(run.assignment.device, run.devices), **self.cfg.grader_env},
                niceness=self.yielder.niceness(run.devices),
                lease_s=self.cfg.lease_s,
                on_empty=forget,
            )
            self.groups[name] = group
        return group

    async def _on_trainer_event(self, run: RunningJob, ev) -> None:
        """One event of the trainer's: reported as the job's state, progress, preparation or samples; a checkpoint
        shipped (one at a time: a newer one while one uploads is skipped, but a pause's is waited for)."""
        a = run.assignment
        if run.shipped:  # the trainer went on after its latest checkpoint: that one was no pause's
            run.shipped.followed.set()
        if isinstance(ev, Started):
            await self._report(run, "running", ev.message or f"training {ev.steps} steps on {ev.device}")
            if isinstance(run.trainer, TakesCalls):  # a session, alone or in a session group
                run.trainer.ready.set()  # it takes calls from now on
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
                self.js, self._subjects(a).samples, _enc.encode(samples), f"{a.job}.{a.attempt}.x{ev.step}{ev.model}"
            )
        elif isinstance(ev, Checkpoint):
            if (run.paused_by or isinstance(run.trainer, TakesCalls)) and run.checkpoint_upload:
                await run.checkpoint_upload  # what a resume needs; a session's client was told each save is kept
            run.shipped = Shipped(ev.step)
            if run.checkpoint_upload and not run.checkpoint_upload.done():
                log.info("job %s: checkpoint at step %d skipped, the previous one is still uploading", a.job, ev.step)
                run.shipped.error = "skipped: the checkpoint before it was still uploading"
            else:
                run.checkpoint_upload = asyncio.create_task(self._ship_checkpoint(run, ev, run.shipped))

    async def _ship_checkpoint(self, run: RunningJob, ev: Checkpoint, shipped: Shipped) -> None:
        """Checkpoints go to the object store as they come, so another node can resume if this one goes; each is
        reported stored, except the one the trainer took as it paused: the paused report names it (_end_paused)."""
        if await self._store_checkpoint(run, ev, shipped) is None:
            return
        if run.paused_by or isinstance(run.trainer, SessionRun) or read_pause(run.trainer):  # maybe the pause's:
            await shipped.followed.wait()  # the trainer's next line (or its end) says
            if run.shipped is shipped and (read_pause(run.trainer) or is_pause(run.ended)):
                return
        try:
            await self._report(run, "running", f"checkpoint at step {ev.step} stored", checkpoint=shipped.info)
        except Exception as e:
            log.warning("job %s: checkpoint at step %d stored, not reported: %s", run.assignment.job, ev.step, e)

    async def _store_checkpoint(self, run: RunningJob, ev: Checkpoint, shipped: Shipped) -> CheckpointInfo | None:
        """The checkpoint stored whole (what its record names), or None, why noted in `shipped`."""
        try:
            shipped.info = await ship_checkpoint(self.nc, self.cfg.node, run.assignment, ev, run.last_progress)
        except Exception as e:
            shipped.error = str(e) or type(e).__name__
            log.warning("job %s: checkpoint at step %d not stored: %s", run.assignment.job, ev.step, shipped.error)
            return None
        run.newest = shipped.info
        return shipped.info
