"""How a Tinker call reaches its model's trainer: each training model is a session job (train.method session) of
the key's tenant, and a call goes to the node that runs the job (names.node(node).session). A model whose job waits
(placed, starting, paused for idling or silence, moved after its node died) is waited for, resumed when paused, and
its call sent again. What the scheduler says of a job is asked once for every call of that model waiting on it
(JobWatch), never once per call."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from schemas import names
from schemas.events import CheckpointList
from schemas.jobs import Error, JobRequest, Rejected, SubmitReply
from schemas.job_status import JobQuery, JobReply, ended_in_pause
from schemas.sessions import (
    CallError,
    ForwardBackward,
    LoadWeights,
    OptimStep,
    SessionCall,
    SessionReply,
    SessionRequest,
)
from schemas.tinker_store import ModelRecord, SessionRecord, session_key
from services import bus
from services.gateway.tinker.futures import CallFailed
from services.gateway.tinker.store import Store

log = logging.getLogger(__name__)
CALL_WAIT_S = 1800.0  # how long a call waits for its session to be placed, started or resumed
POLL_S = 0.25
CALL_S = 900.0  # one call at most (a large batch on a slow device)
WATCH_S = 5.0  # while a call runs longer than this, its job is checked this often
TERMINAL = ("succeeded", "failed", "cancelled", "stopped")
ROUTES_KEPT = 4096


@dataclass
class Route:
    """Where a model's calls went lately, as this gateway knows it."""

    node: str | None = None
    attempt: int = 0  # the job's attempt its calls go to (the node answers 'ask again' if it runs another)
    trained: int = 0  # the attempt that answered its latest call that changed the session (changes()): how that
    # attempt ends says whether calls answered were lost. 0: none at risk (none yet, or since a pause was seen to
    # keep them, or since a loss was told). A sample or a save changes nothing: the attempt it ran on risks nothing
    lost: str = ""  # it moved after its node went away: what its next ordered call is told
    telling: tuple[int, str] | None = None  # the seq_id told `lost` and what, until its outcome is surely stored


class JobWatch:
    """A job's state as the scheduler tells it, asked once for all who wait on it and kept POLL_S."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self._asking: dict[str, asyncio.Future] = {}
        self._answers: collections.OrderedDict[str, tuple[float, JobReply | Error]] = collections.OrderedDict()

    async def job(self, tenant: str, job: str) -> JobReply | Error:
        cached = self._answers.get(job)
        if cached is not None and time.monotonic() - cached[0] < POLL_S:
            return cached[1]
        asking = self._asking.get(job)
        if asking is None:
            asking = self._asking[job] = asyncio.ensure_future(self._ask(tenant, job))
            asking.add_done_callback(lambda _: self._asking.pop(job, None))
        return await asyncio.shield(asking)

    async def _ask(self, tenant: str, job: str) -> JobReply | Error:
        reply = await bus.request(self.nc, names.jobs_api(tenant).job, JobQuery(job), JobReply | Error)
        self._answers[job] = (time.monotonic(), reply)
        self._answers.move_to_end(job)
        while len(self._answers) > ROUTES_KEPT:
            self._answers.popitem(last=False)
        return reply

    def forget(self, job: str) -> None:
        """Its state changed by this gateway's own hand (resumed): ask again next time."""
        self._answers.pop(job, None)


def changes(call: SessionCall) -> bool:
    """Whether a call changes the session's state (its adapter, optimizer or gradients): what a node lost loses."""
    return isinstance(call, (OptimStep, LoadWeights)) or (isinstance(call, ForwardBackward) and not call.forward_only)


def refused(reply: SessionReply) -> bool:
    """Whether the session refused the call, naming the field to change: it changed nothing (a call that failed as
    it ran, with no field named, may have: counted as a change, its loss told rather than kept silent)."""
    return isinstance(reply, CallError) and bool(reply.field)


class NotKept(Exception):
    """The model's record could not be written before an answer it must precede: the answer is not kept either
    (the gateway gives the model up; the next sends the call again under its call id)."""


class Trainers:
    def __init__(self, nc, store: Store) -> None:
        self.nc, self.store, self.watch = nc, store, JobWatch(nc)
        self.routes: collections.OrderedDict[str, Route] = collections.OrderedDict()
        # writes the record of a model whose calls run here with its route (order.py): the attempt trained on is
        # in the store before any answer of that attempt is
        self.keep: Callable[[ModelRecord], Awaitable[None]] | None = None

    def route(self, model: ModelRecord) -> Route:
        """Where this gateway last sent the model's calls (the record's word when it has none)."""
        route = self.routes.get(model.id)
        return route if route is not None else self.took(model)

    def took(self, model: ModelRecord) -> Route:
        """The model's calls run here from now: what this gateway knew of them is forgotten for the record's (another
        gateway may have run them since, seen the session move, and told the client)."""
        told = (model.lost_at, model.lost) if model.lost and model.lost_at is not None else None
        route = self.routes[model.id] = Route(trained=model.attempt, lost="" if told else model.lost, telling=told)
        while len(self.routes) > ROUTES_KEPT:
            self.routes.popitem(last=False)
        return route

    async def submit(self, tenant: str, request: JobRequest) -> str:
        """The session job, submitted as the tenant's (a create sent again is the same job: its idempotency key);
        CallFailed says why not."""
        reply = await bus.request(self.nc, names.jobs_api(tenant).submit, request, SubmitReply)
        if isinstance(reply, Rejected):
            raise CallFailed("; ".join(f"{e.field}: {e.reason}" if e.field else e.reason for e in reply.errors))
        job = getattr(reply, "job", None)  # accepted, or its store did not answer yet: the same job when sent again
        if not isinstance(job, str):
            raise CallFailed(f"the scheduler answered {type(reply).__name__} to the session's submission", "server")
        return job

    async def send(self, model: ModelRecord, call: SessionCall, call_id: str, seq: int | None = None) -> SessionReply:
        """The session's answer, waiting through its job's placement, start, pause or move to another node. After a
        move, the model's next ordered call (`seq`, its seq_id) fails once, saying so (a sample does not: it has
        no state to lose); an ordered call that changes the session makes the attempt that answers it the one
        trained on, in the model's record before the answer is kept."""
        route, deadline = self.route(model), time.monotonic() + CALL_WAIT_S
        request = SessionRequest(job=model.job, tenant=model.tenant, call=call, call_id=call_id)
        ordered, looked = seq is not None, False  # looked: its job seen during this call
        while time.monotonic() < deadline:
            if seq is not None and route.telling is not None and route.telling[0] == seq:
                raise CallFailed(route.telling[1])  # the call told, sent again: its told answer was not stored
            if seq is not None and route.lost:
                await self._told(model, route, seq)
            # an ordered call goes to an attempt other than the one trained on only once the loss is judged
            if route.node is not None and (not ordered or looked or route.trained in (0, route.attempt)):
                request.attempt = route.attempt
                reply = await self._ask(model, route, route.node, request)
                if not (isinstance(reply, CallError) and reply.retry):
                    if ordered and changes(call) and not refused(reply) and route.trained != request.attempt:
                        await self._trained_on(model, route, request.attempt)
                    return reply
            route.node, looked = await self._where(model, route, ordered), True
            if route.node is None or (ordered and route.lost):
                await asyncio.sleep(POLL_S)
        raise CallFailed(f"model {model.id}'s session did not start within {CALL_WAIT_S:.0f} s", "server")

    async def _told(self, model: ModelRecord, route: Route, seq: int) -> None:
        """The loss is told to the ordered call `seq`: written to the model's record first, naming that call (a
        gateway that dies after storing the told answer, before its next write, leaves the next one the calls
        after it to send untold: the client heard it), then the call fails with it."""
        route.telling, route.lost = (seq, route.lost), ""
        await self._kept(model)
        raise CallFailed(route.telling[1])

    async def _trained_on(self, model: ModelRecord, route: Route, attempt: int) -> None:
        """`attempt` answered a call that changed the session: how it ends now says whether that was lost. Written to
        the model's record first (a gateway that stops before its next write, or dies, leaves the next one the
        attempt to judge by: not one whose pause kept less than the client saw)."""
        route.trained = attempt
        await self._kept(model)

    async def _kept(self, model: ModelRecord) -> None:
        """The model's record written with its route before an answer is kept (NotKept: the answer is not either)."""
        if self.keep is not None:
            try:
                await self.keep(model)
            except Exception as e:
                raise NotKept(f"model {model.id}'s record was not written ({type(e).__name__}: {e})") from e

    async def _ask(self, model: ModelRecord, route: Route, node: str, request: SessionRequest) -> SessionReply:
        """The node's answer; while a long call runs, the job is watched, so a node that died mid-call (its job
        re-queued, or another attempt running) ends the wait at once instead of at the request's timeout."""
        asking = asyncio.create_task(bus.request(self.nc, names.node(node).session, request, SessionReply, CALL_S))
        try:
            while not asking.done():
                await asyncio.wait([asking], timeout=WATCH_S)
                if not asking.done() and not await self._still_on(model, route, node):
                    log.info("model %s: its job left node %s during a call; looking for it", model.id, node)
                    return CallError(message=f"node {node} no longer runs the session", retry=True)
            return asking.result()
        except bus.PayloadTooLarge:
            raise CallFailed(
                "the call is too large for one message on the bus: send fewer datums at a time (the client's "
                "forward_backward chunks follow client/config) or shorter ones"
            ) from None
        except bus.RequestError as e:
            if "did not decode" in str(e):  # an answer, but not a session's: asking again gets the same
                raise CallFailed(f"the session's node answered what is not an answer ({e})", "server") from None
            log.info("model %s: its node %s did not answer (%s); looking for its job", model.id, node, e)
            return CallError(message=str(e), retry=True)
        finally:
            if not asking.done():
                asking.cancel()
                await asyncio.gather(asking, return_exceptions=True)

    async def _still_on(self, model: ModelRecord, route: Route, node: str) -> bool:
        try:
            reply = await self.watch.job(model.tenant, model.job)
        except bus.RequestError:
            return True  # the scheduler between leaders: keep waiting for the node
        return (
            isinstance(reply, JobReply)
            and reply.job.node == node
            and reply.job.attempt == route.attempt
            and reply.job.state == "running"
        )

    async def _where(self, model: ModelRecord, route: Route, ordered: bool = False) -> str | None:
        """The node that runs the model's job now; a paused job is resumed, an ended one fails the call, and one
        that moved after its node went away fails the next ordered call, saying where it goes on from (judged
        for an ordered call alone: a sample may go through a gateway that does not run the model's calls)."""
        reply = await self.watch.job(model.tenant, model.job)
        if isinstance(reply, Error):
            raise CallFailed(f"model {model.id}: {reply.error}")
        job = reply.job
        if job.state in TERMINAL:
            raise CallFailed(f"model {model.id}'s session has ended ({job.state}: {job.message})")
        if job.state == "paused":  # idle, silent, or a serving engine took its device: it goes on from its checkpoint
            await self._client_back(model)
            await bus.request(self.nc, names.jobs_api(model.tenant).resume, JobQuery(model.job), JobReply | Error)
            self.watch.forget(model.job)
        if job.state != "running":
            return None
        # the attempt that answered its calls ended in a pause (idle, silent, an engine's, a user's, preempted; seen
        # by this gateway or not): its checkpoint holds every call answered, and the attempts after it ran none
        # that changed the session: nothing is at risk until the next does. Any other end (its node went away,
        # its agent shut down and handed it back) lost the calls since the last save_state: told to the next
        # ordered call (send), once: nothing is at risk after it either
        moved = ordered and route.trained not in (0, job.attempt)
        lost = moved and not ended_in_pause(job.paused_runs, route.trained)
        route.attempt, route.trained = job.attempt, 0 if moved else route.trained
        if lost:
            route.lost = (
                f"model {model.id}'s node went away; its session goes on on {job.node} from its last saved state "
                f"(attempt {job.attempt}): calls since that save_state were lost; load_state it, or redo them"
            )
        return job.node

    async def _client_back(self, model: ModelRecord) -> None:
        """A call resumes a paused job, so its client is back: its session is heard now, before the job resumes. A
        session paused for silence gives its places up to its tenant's bound (reaper.yield_silent) by a write at the
        revision it read, which this write makes lose: a client back after silence_s, before its next heartbeat,
        is not finished under its own calls. A session finished first fails the call (its jobs are cancelled)."""

        def heard(s: SessionRecord) -> bool:
            s.heard, s.paused = time.time(), False
            return s.finished is None

        if not model.session:  # a serving sampler belongs to no client session
            return
        written = await self.store.modify(self.store.kv, session_key(model.tenant, model.session), SessionRecord, heard)
        if written is not None and written.finished is not None:
            raise CallFailed(f"model {model.id}'s session has ended: create a new one")

    async def running_on(self, model: ModelRecord) -> str | None:
        """The node its job runs on now, if it runs (nothing resumed)."""
        reply = await self.watch.job(model.tenant, model.job)
        return reply.job.node if isinstance(reply, JobReply) and reply.job.state == "running" else None

    async def stored(self, tenant: str, job: str, step: int, timeout: float = 120.0) -> None:
        """Until the job has stored its checkpoint at `step` (a save is stored just after it answers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = await bus.request(
                self.nc, names.jobs_api(tenant).checkpoints, JobQuery(job), CheckpointList | Error
            )
            if isinstance(reply, CheckpointList) and any(c.step == step for c in reply.checkpoints):
                return
            await asyncio.sleep(POLL_S)
        raise CallFailed(f"the state at step {step} of job {job} was not stored within {timeout:.0f} s", "server")

    async def stop(self, model: ModelRecord) -> None:
        """The client finished: the session stops and stores its adapter (the job's artifact). One paused (idle, or
        its client silent) holds no device and cannot stop: it is cancelled, its checkpoints (the pause's has its
        adapter) staying in the store, rather than left paused for ever."""
        if not model.job:
            return
        self.watch.forget(model.job)
        now = await self.watch.job(model.tenant, model.job)
        if isinstance(now, JobReply) and now.job.state == "paused":
            await self.cancel(model.tenant, model.job)
        else:
            await self._job_verb(model, "stop")
        self.watch.forget(model.job)

    async def pause(self, model: ModelRecord) -> None:
        """Its client went silent: checkpointed and its device freed; the next call resumes it."""
        if model.job:
            await self._job_verb(model, "pause")
            self.watch.forget(model.job)

    async def cancel_model(self, model: ModelRecord) -> None:
        if model.job:
            await self.cancel(model.tenant, model.job)
            self.watch.forget(model.job)

    async def cancel(self, tenant: str, job: str) -> None:
        """A job made for nothing (another gateway's stood): it goes."""
        reply = await bus.request(self.nc, names.jobs_api(tenant).cancel, JobQuery(job), JobReply | Error)
        if isinstance(reply, Error):
            log.info("job %s of %s was not cancelled: %s", job, tenant, reply.error)

    async def _job_verb(self, model: ModelRecord, verb: str) -> None:
        subject = getattr(names.jobs_api(model.tenant), verb)
        reply = await bus.request(self.nc, subject, JobQuery(model.job), JobReply | Error)
        if isinstance(reply, Error):
            log.info("model %s: %s of its session job: %s", model.id, verb, reply.error)
