"""The Tinker API's sessions and training models as the gateway holds them, and how a call reaches a model's
trainer: each training model is a session job (train.method session) of the key's tenant; its calls run in the
order the client numbered them (seq_id: a client sends a batch's chunks at once, the first last), each sent to the
node that runs the job (names.node(node).session). A model whose job waits (placed, starting, paused for idling,
moved after its node died) is waited for, resumed when paused, and its call sent again."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

from schemas import names
from schemas.jobs import Accepted, Error, JobQuery, JobReply, JobRequest, Rejected, SubmitReply
from schemas.events import CheckpointList
from schemas.sessions import CallError, Ping, PingResult, SessionCall, SessionReply, SessionRequest, SessionSpec
from services import bus
from services.gateway.tinker.futures import CallFailed

log = logging.getLogger(__name__)
CALL_WAIT_S = 1800.0  # how long a call waits for its session to be placed, started or resumed
POLL_S = 0.25
CALL_S = 900.0  # one call at most (a large batch on a slow device)
WATCH_S = 5.0  # while a call runs longer than this, its job is checked this often
TERMINAL = ("succeeded", "failed", "cancelled", "stopped")


@dataclass
class Model:
    """A training model: one session job of its tenant, and its calls in their order."""

    id: str  # "<session_id>:train:<n>", as the client derives it
    tenant: str
    job: str
    base_model: str
    node: str | None = None  # where its job ran when last asked
    attempt: int = 0  # the job's attempt its calls went to: another one means the session moved or came back
    resumed: bool = False  # the gateway resumed it (idle, or paused for an engine): it goes on exactly where it was
    lost: str = ""  # it moved after its node went away: what its next training call is told
    info: PingResult | None = None
    next_seq: int = 1  # the seq_id whose turn it is (create_model was 0)
    waiting: dict[int, tuple[SessionCall | None, asyncio.Future]] = field(default_factory=dict)
    requests: dict[int, str] = field(default_factory=dict)  # seq_id -> its request id (a re-send gets the same)
    pump: asyncio.Task | None = None
    samplers: set[str] = field(default_factory=set)  # the sampler weights it saved, by name
    saves: dict[str, int] = field(default_factory=dict)  # the states it saved: name -> the step each was taken at
    spec: SessionSpec | None = None  # its adapter, for a model started from one of its states


@dataclass
class Session:
    id: str
    tenant: str
    heard: float = field(default_factory=time.monotonic)
    models: int = 0  # model_seq_ids handed out
    samplers: int = 0
    finished: bool = False


@dataclass
class Sampler:
    """A sampling session: a training model's adapter as it is (weights None) or as a save left it."""

    id: str
    tenant: str
    model: str
    weights: str | None
    base_model: str
    model_path: str | None


class Sessions:
    """Every session, training model and sampling session of the gateway (held in memory)."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}

    def new_session(self, tenant: str) -> Session:
        session = Session("sess-" + secrets.token_hex(8), tenant)
        self.sessions[session.id] = session
        return session

    def session(self, tenant: str, session_id: str) -> Session | None:
        s = self.sessions.get(session_id)
        return s if s is not None and s.tenant == tenant else None  # another tenant's is none of its own

    def of(self, session: Session) -> list[Model]:
        return [m for m in self.models.values() if m.id.startswith(session.id + ":")]

    def model(self, tenant: str, model_id: str) -> Model | None:
        m = self.models.get(model_id)
        return m if m is not None and m.tenant == tenant else None

    async def create(self, session: Session, seq: int, request: JobRequest, base_model: str) -> Model:
        """Submit the model's session job as the tenant's, and wait until its trainer answers."""
        model = await self.submit_job(session, f"{session.id}:train:{seq}", request, base_model)
        info = await self.send(model, Ping())
        if not isinstance(info, PingResult):
            raise CallFailed(f"model {model.id}'s session did not start: {getattr(info, 'message', info)}")
        model.info = info
        return model

    async def submit_job(self, session: Session, model_id: str, request: JobRequest, base_model: str) -> Model:
        """The model's session job, submitted as the tenant's (it runs once placed); CallFailed says why not."""
        reply = await bus.request(self.nc, names.jobs_api(session.tenant).submit, request, SubmitReply)
        if isinstance(reply, Rejected):
            raise CallFailed("; ".join(f"{e.field}: {e.reason}" if e.field else e.reason for e in reply.errors))
        assert isinstance(reply, Accepted)
        model = Model(model_id, session.tenant, reply.job, base_model, spec=request.session)
        self.models[model.id] = model
        return model

    def submit(self, model: Model, seq: int, call: SessionCall | None) -> asyncio.Future:
        """The call's turn comes after every lower seq_id's (None: a seq_id refused at the door, only skipped)."""
        waiter = asyncio.get_running_loop().create_future()
        model.waiting[seq] = (call, waiter)
        if model.pump is None or model.pump.done():
            model.pump = asyncio.create_task(self._pump(model))
        return waiter

    async def _pump(self, model: Model) -> None:
        while model.next_seq in model.waiting:
            call, waiter = model.waiting.pop(model.next_seq)
            model.next_seq += 1
            if call is None or waiter.done():
                continue
            try:
                waiter.set_result(await self.send(model, call, training=True))
            except asyncio.CancelledError:  # the session ended (finish): this call and the rest are answered so
                if not waiter.done():
                    waiter.set_exception(CallFailed(f"model {model.id}'s session has finished"))
                raise
            except Exception as e:  # the call's own error goes to its future
                if not waiter.done():
                    waiter.set_exception(e)

    async def send(self, model: Model, call: SessionCall, training: bool = False) -> SessionReply:
        """The session's answer, waiting through its job's placement, start, idle pause or move to another node.
        After a move, the next training call fails once, saying so (a sample does not: it carries no state)."""
        deadline, call_id = time.monotonic() + CALL_WAIT_S, secrets.token_hex(8)
        request = SessionRequest(job=model.job, tenant=model.tenant, call=call, call_id=call_id)
        while time.monotonic() < deadline:
            if training and model.lost:
                lost, model.lost = model.lost, ""
                raise CallFailed(lost)
            if model.node is not None:
                reply = await self._ask(model, model.node, request)
                if not (isinstance(reply, CallError) and reply.retry):
                    return reply
            model.node = await self._where(model)
            if model.node is None or (training and model.lost):
                await asyncio.sleep(POLL_S)
        raise CallFailed(f"model {model.id}'s session did not start within {CALL_WAIT_S:.0f} s", "server")

    async def _ask(self, model: Model, node: str, request: SessionRequest) -> SessionReply:
        """The node's answer; while a long call runs, the job is watched, so a node that died mid-call (its job
        re-queued, or another attempt running) ends the wait at once instead of at the request's timeout."""
        asking = asyncio.create_task(bus.request(self.nc, names.node(node).session, request, SessionReply, CALL_S))
        try:
            while not asking.done():
                await asyncio.wait([asking], timeout=WATCH_S)
                if not asking.done() and not await self._still_on(model, node):
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

    async def _still_on(self, model: Model, node: str) -> bool:
        try:
            reply = await bus.request(self.nc, names.jobs_api(model.tenant).job, JobQuery(model.job), JobReply | Error)
        except bus.RequestError:
            return True  # the scheduler between leaders: keep waiting for the node
        return (
            isinstance(reply, JobReply)
            and reply.job.node == node
            and reply.job.attempt == model.attempt
            and (reply.job.state == "running")
        )

    async def _where(self, model: Model) -> str | None:
        """The node that runs the model's job now; a paused job is resumed, an ended one fails the call, and one
        that moved after its node went away fails this call, saying where it goes on from."""
        api = names.jobs_api(model.tenant)
        reply = await bus.request(self.nc, api.job, JobQuery(model.job), JobReply | Error)
        if isinstance(reply, Error):
            raise CallFailed(f"model {model.id}: {reply.error}")
        job = reply.job
        if job.state in TERMINAL:
            raise CallFailed(f"model {model.id}'s session has ended ({job.state}: {job.message})")
        if job.state == "paused":  # idle, or a serving engine took its device: it goes on from its checkpoint
            model.resumed = True
            await bus.request(self.nc, api.resume, JobQuery(model.job), JobReply | Error)
        if job.state != "running":
            return None
        moved, model.attempt = model.attempt not in (0, job.attempt) and not model.resumed, job.attempt
        model.resumed = False
        if moved:  # told to the next training call (sessions.send)
            model.lost = (
                f"model {model.id}'s node went away; its session goes on on {job.node} from its last saved state "
                f"(attempt {job.attempt}): calls since that save_state were lost; load_state it, or redo them"
            )
        return job.node

    async def stored(self, model: Model, step: int, timeout: float = 120.0) -> None:
        """Until the model's job has stored its checkpoint at `step` (a save is stored just after it answers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = await bus.request(
                self.nc, names.jobs_api(model.tenant).checkpoints, JobQuery(model.job), CheckpointList | Error
            )
            if isinstance(reply, CheckpointList) and any(c.step == step for c in reply.checkpoints):
                return
            await asyncio.sleep(POLL_S)
        raise CallFailed(f"model {model.id}'s state at step {step} was not stored within {timeout:.0f} s", "server")

    async def end(self, model: Model) -> None:
        """The client finished: the session stops and stores its adapter (the job's artifact)."""
        reply = await bus.request(self.nc, names.jobs_api(model.tenant).stop, JobQuery(model.job), JobReply | Error)
        if isinstance(reply, Error):
            log.info("model %s: stopping its session job: %s", model.id, reply.error)
        if model.pump is not None:
            model.pump.cancel()
        for _, waiter in model.waiting.values():
            if not waiter.done():
                waiter.set_exception(CallFailed(f"model {model.id}'s session has finished"))
        model.waiting.clear()

    async def close(self) -> None:
        pumps = [m.pump for m in self.models.values() if m.pump is not None and not m.pump.done()]
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
