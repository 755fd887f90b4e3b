"""A training session's trainer (train.method session): a trainer run whose stdin takes calls and whose stdout
answers them beside its events, or a member of a session group (group_run.GroupedSession: the group's process
takes its calls and answers them tagged with its job). The agent passes each call that reaches it on
names.node(node).session to the job's trainer, one at a time, under the gateway's call id (the trainer answers a
call it ran before as it did, even one a previous attempt ran: trainer/session/applied_calls.py), and replies with the
trainer's answer; a named sampler save goes to the object store first, and one sampled is fetched back if it is
not on this node (sampler_saves.py)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging

from collections.abc import Awaitable, Callable

import msgspec

from schemas.events import TrainerEvent
from schemas.sessions import CallError, SessionAnswer, SessionCall, SessionLine, SessionReply, SessionRequest
from services import bus
from services.agent.runner import TrainerRun
from services.agent.sampler_saves import SamplerSaves, stored
from services.aio import cancel_and_wait

log = logging.getLogger(__name__)
_decode = msgspec.json.Decoder(TrainerEvent | SessionAnswer)
_encode = msgspec.json.Encoder()
CALL_TIMEOUT_S = 600.0  # one call at most (a forward_backward of a large batch on a slow device)
REMEMBERED = 64  # call ids whose answers are kept for a try sent again while the attempt runs
Then = Callable[[SessionReply], Awaitable[SessionReply]]  # what becomes of the trainer's answer before it is sent


class SessionLost(Exception):
    """A training session could not be given back what it saved: it fails rather than start again from nothing."""


class TakesCalls:
    """A session's trainer as the agent hands it calls: one at a time in the order they came, each answered by its
    number; a call id seen lately gets that call's answer (a try sent again by the gateway), never a second run.
    A session alone (SessionRun) and a member of a session group (group_run.GroupedSession) write their lines each
    their own way (`_line`, `_stdin`)."""

    def _init_calls(self) -> None:
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.turn = asyncio.Lock()  # one call at a time, in the order they came
        self.ready = asyncio.Event()  # the trainer said Started: it takes calls
        self.calls: collections.OrderedDict[str, asyncio.Future] = collections.OrderedDict()  # by call_id, the last

    def _stdin(self) -> asyncio.StreamWriter | None:
        """Where the call's line goes; None while the trainer cannot take it (starting, or gone)."""
        raise NotImplementedError

    def _line(self, number: int, call: SessionCall, call_id: str) -> bytes:
        raise NotImplementedError

    @property
    def label(self) -> str:
        raise NotImplementedError

    def answered(self, number: int, reply: SessionReply) -> None:
        waiter = self.pending.pop(number, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)

    def calls_end(self) -> None:
        """The trainer ended (or the session left its group): the calls it never answered are tried again where
        the session goes on."""
        for waiter in self.pending.values():
            if not waiter.done():
                waiter.set_result(CallError(message="the session's trainer ended; ask again", retry=True))

    async def call(
        self, call: SessionCall, call_id: str = "", timeout: float = CALL_TIMEOUT_S, then: Then | None = None
    ) -> SessionReply:
        """The trainer's answer to `call` (and what `then` made of it, once for every try), or why there is none."""
        if not call_id:
            return await self._call(call, call_id, timeout, then)
        if call_id not in self.calls:
            self.calls[call_id] = asyncio.ensure_future(self._call(call, call_id, timeout, then))
            while len(self.calls) > REMEMBERED:
                self.calls.popitem(last=False)
        reply = await asyncio.shield(self.calls[call_id])
        if isinstance(reply, CallError) and reply.retry:
            self.calls.pop(call_id, None)  # it never ran: a later try runs it
        return reply

    async def _call(self, call: SessionCall, call_id: str, timeout: float, then: Then | None) -> SessionReply:
        reply = await self._turn(call, call_id, timeout)
        return reply if then is None or isinstance(reply, CallError) else await then(reply)

    async def _turn(self, call: SessionCall, call_id: str, timeout: float) -> SessionReply:
        async with self.turn:
            stdin = self._stdin() if self.ready.is_set() else None
            if stdin is None:
                return CallError(message="the session is starting; ask again", retry=True)
            number = next(self.ids)
            waiter = self.pending[number] = asyncio.get_running_loop().create_future()
            try:
                stdin.write(self._line(number, call, call_id))
                await stdin.drain()
                return await asyncio.wait_for(waiter, timeout)
            except (ConnectionError, BrokenPipeError):
                return CallError(message="the session's trainer has ended; ask again", retry=True)
            except asyncio.TimeoutError:
                log.warning("session %s did not answer call %d within %.0f s", self.label, number, timeout)
                return CallError(message=f"the session did not answer within {timeout:.0f} s", retry=True)
            finally:
                self.pending.pop(number, None)


class SessionRun(TrainerRun, TakesCalls):
    """A session alone: its own trainer process, its calls on the process's stdin."""

    decoder = _decode
    stdin = asyncio.subprocess.PIPE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_calls()

    async def run(self, on_event):
        try:
            return await super().run(on_event)
        finally:
            self.calls_end()

    def took(self, line: object) -> bool:
        if isinstance(line, SessionAnswer):
            self.answered(line.id, line.reply)
            return True
        return False

    def _stdin(self) -> asyncio.StreamWriter | None:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.returncode is not None:
            return None
        return proc.stdin

    def _line(self, number: int, call: SessionCall, call_id: str) -> bytes:
        return _encode.encode(SessionLine(id=number, call=call, call_id=call_id)) + b"\n"

    @property
    def label(self) -> str:
        return self.spec.job


class SessionDesk:
    """Where calls for this node's sessions arrive (names.node(node).session): each answered in a task of its own,
    so a long call of one session never holds up another's; one session's calls still run in the order they came."""

    def __init__(self, jobs, saves: SamplerSaves | None = None) -> None:
        self.jobs = jobs  # job -> the agent's RunningJob, as the agent holds them
        self.saves = saves  # None: an agent that stores no named sampler saves (they are refused, saying so)
        self.tasks: set[asyncio.Task] = set()
        self.answer = bus.handler(self.call, SessionRequest)

    async def on_message(self, msg) -> None:
        task = asyncio.create_task(self._answer(msg))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    async def _answer(self, msg) -> None:
        await self.answer(msg)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception():
            log.error("a session call failed in the agent: %r", task.exception(), exc_info=task.exception())

    async def call(self, request: SessionRequest) -> SessionReply:
        run = self.jobs().get(request.job)
        if run is None or run.assignment.tenant != request.tenant:  # another tenant's session is none of its own
            return CallError(message=f"session {request.job} does not run on this node", retry=True)
        if request.attempt and run.attempt != request.attempt:  # a new attempt here: the gateway decides what it was
            return CallError(message=f"session {request.job} runs attempt {run.attempt} here, not {request.attempt}",
                             retry=True)  # fmt: skip
        if not isinstance(run.trainer, TakesCalls):
            return CallError(message="the session is starting; ask again", retry=True)
        saves = self.saves
        if saves is None:
            if stored(request.call):
                return CallError(message="this node's agent stores no named sampler saves (its SessionDesk was made "
                                 "without SamplerSaves); save unnamed, or run the call on an agent of this version")  # fmt: skip
            return await run.trainer.call(request.call, request.call_id)
        if (missing := await saves.before(run, request.call)) is not None:
            return missing

        async def then(reply: SessionReply) -> SessionReply:
            return await saves.after(run, request.call, reply)

        return await run.trainer.call(request.call, request.call_id, then=then)

    async def close(self) -> None:
        await cancel_and_wait(list(self.tasks))
