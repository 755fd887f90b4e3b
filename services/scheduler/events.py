"""What agents report of their jobs: progress (kept in memory) and states (applied from a durable consumer)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import msgspec
from nats.errors import TimeoutError as NatsTimeout

from schemas import subject_parts
from schemas.events import Progress, StateChange
from schemas.job_status import ACTIVE_STATES, PAUSES_KEPT, TERMINAL_STATES, JobStatus, with_pause
from services.aio import sleep_unless_stopped
from schemas.artifacts import KEEP_CHECKPOINTS
from services.scheduler import registry_asks
from services.scheduler.core import Job, SchedulerCore
from services.scheduler.pausing import is_preemption

log = logging.getLogger(__name__)
_progress = msgspec.json.Decoder(Progress)
_state = msgspec.json.Decoder(StateChange)


class JobEvents:
    """Applies what agents report of their jobs to the core: progress as it comes, states in order, durably."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core

    async def on_progress(self, msg) -> None:
        try:
            p = _progress.decode(msg.data)
        except msgspec.DecodeError:
            return
        job_id, node = subject_parts.job_and_node_of_subject(msg.subject)
        job = self.core.jobs.get(job_id)
        if (
            job
            and job.status.state in ACTIVE_STATES
            and job.status.node == node  # only from the node that holds it
            and subject_parts.tenant_of_event_subject(msg.subject) == job.stored.tenant
        ):  # under the job's own tenant
            job.status = msgspec.structs.replace(
                job.status,
                step=p.step,
                steps=p.steps,
                loss=p.loss if p.loss is not None else job.status.loss,
                eval_loss=p.eval_loss if p.eval_loss is not None else job.status.eval_loss,
                peak_mib=p.peak_mib if p.peak_mib is not None else job.status.peak_mib,
            )

    async def consume_states(self, sub, lost: asyncio.Event, stop: asyncio.Event) -> None:
        while not (stop.is_set() or lost.is_set()):
            try:
                msgs = await sub.fetch(batch=256, timeout=0.5)
            except (NatsTimeout, asyncio.TimeoutError):  # nothing new (nats-py raises either)
                continue
            except Exception as e:
                log.warning("reading job states: %s: %s; trying again", type(e).__name__, e)
                await sleep_unless_stopped(stop, 0.2)
                continue
            # one job's events in order; different jobs' at once
            by_job = defaultdict(list)
            for msg in msgs:
                by_job[subject_parts.job_and_node_of_subject(msg.subject)[0]].append(msg)
            await asyncio.gather(*(self._apply_in_order(batch) for batch in by_job.values()))

    async def _apply_in_order(self, batch) -> None:
        for m in batch:
            try:
                await self.apply_state(m)
                await m.ack()
            except Exception as e:  # not acked: JetStream delivers it again (ack_wait), after the ones before it
                log.warning(
                    "could not apply a state of job %s yet (%s: %s); it will be redelivered",
                    subject_parts.job_and_node_of_subject(m.subject)[0],
                    type(e).__name__,
                    e,
                )
                return

    async def apply_state(self, msg) -> None:
        core = self.core
        try:
            ev = _state.decode(msg.data)
        except msgspec.DecodeError as e:
            log.warning("ignored a job state on %s that did not decode: %s", msg.subject, e)
            return
        job_id, node = subject_parts.job_and_node_of_subject(msg.subject)
        if (ev.job, ev.node) != (job_id, node):
            log.warning("ignored a state of job %s from node %s sent on %s", ev.job, ev.node, msg.subject)
            return
        job = await core.lookup(ev.job)  # a store that cannot be read raises: the event comes again
        if job is None:
            log.warning("ignored a state of job %s: no such job in the jobs bucket", ev.job)
            return
        if not _for_this_attempt(job, ev, node, msg.subject):
            return

        seq = msg.metadata.sequence.stream

        def current(s: JobStatus) -> bool:  # not from an earlier attempt, not after the end, not a repeat, and
            return (
                ev.attempt == s.attempt
                and s.state not in TERMINAL_STATES  # not older than one applied: a
                and (ev.state, ev.message) != (s.state, s.message)  # state that failed once and comes again
                and seq > s.event_seq
            )  # after a later one must not undo it

        changes: dict = {"event_seq": seq}
        if ev.checkpoint is not None:
            kept = [c for c in job.status.checkpoints if c.step != ev.checkpoint.step] + [ev.checkpoint]
            changes.update(checkpoint=ev.checkpoint.name, checkpoints=kept[-KEEP_CHECKPOINTS:])
        if ev.state == "queued":  # the agent handed it back (shutting down, or split out of a group) before it ended
            if ev.train_alone:  # it never joins a group again: its step ran out of memory in one
                changes["train_alone"] = ev.train_alone
            await core.requeue(job, ev.message, when=current, **changes)
            return
        changes["artifacts"] = ev.artifacts or job.status.artifacts
        if ev.state == "paused":
            changes["paused_by"] = ev.paused_by or "user"
            changes["paused_attempts"] = [*job.status.paused_attempts, ev.attempt][-PAUSES_KEPT:]
            changes["paused_runs"] = with_pause(job.status.paused_runs, ev.attempt)
            if is_preemption(ev.paused_by):
                await self._preempted(job, ev, current, changes)
                return
        written = await core.set_state(job, ev.state, ev.message, when=current, **changes)
        if written and ev.state == "succeeded" and (spec := job.stored.request.register) is not None:
            core.spawn(self._register(job, spec))

    async def _preempted(self, job: Job, ev: StateChange, current, changes: dict) -> None:
        """A job paused by preemption goes back to the queue at once, ahead of its tenant's others of its priority,
        to go on from the checkpoint it just stored; a Tinker session's stays paused, as after an idle pause (its
        next call resumes it)."""
        why, changes["preempted_at"] = ev.paused_by or "", time.time()
        if job.stored.request.session is not None:
            await self.core.set_state(job, "paused", f"{why}; {ev.message}", when=current, **changes)
            return
        del changes["paused_by"]
        goes_on = (
            "it goes on from its checkpoint"
            if changes.get("checkpoint") or job.status.checkpoint
            else "it starts again"
        )
        await self.core.requeue(
            job, f"{why}; {ev.message}; queued again, {goes_on}", when=current, preempted=why, **changes
        )

    async def _register(self, job: Job, spec) -> None:
        """A job that asked to be registered: the registry is asked to make its adapter the next version of its name
        (promoted if asked), again while it does not answer; the job's message says how that went."""
        core = self.core
        note = await registry_asks.register(core.nc, job.id, spec, core.lost)
        if note is None:  # this scheduler stopped leading meanwhile: logged, the job's record left as it is
            return
        try:
            await core.set_state(job, job.status.state, f"{job.status.message}; {note}")
        except Exception as e:  # the registration stands; only its note in the job's message is missing
            log.warning("job %s: could not note its registration (%s)", job.id, e)


def _for_this_attempt(job: Job, ev: StateChange, node: str, subject: str) -> bool:
    """Whether a state event is the job's own: sent under its tenant, by the node of its current attempt (an ended
    job's last word from any node is looked at: it is refused later if it would change anything)."""
    if subject_parts.tenant_of_event_subject(subject) != job.stored.tenant:
        log.warning(
            "ignored a state of job %s from node %s sent on %s: not under the job's tenant", ev.job, node, subject
        )
        return False
    if (node, ev.attempt) != (job.status.node, job.status.attempt) and job.status.state not in TERMINAL_STATES:
        log.warning(
            "ignored %r of job %s from node %s (attempt %d): the job's attempt %d is %s",
            ev.state,
            ev.job,
            node,
            ev.attempt,
            job.status.attempt,
            f"on node {job.status.node}" if job.status.node else "not on any node",
        )
        return False
    return True
