"""Follow a job's events from the start of the JOBS stream until it ends: the CLI's live view."""

from __future__ import annotations

import asyncio
import sys

import msgspec
from nats.aio.client import Client
from nats.js.api import DeliverPolicy

from schemas import names, subject_parts
from schemas.events import (
    EventPage,
    EventsQuery,
    JobEvent,
    Preparing,
    Progress,
    ReinforcementMetrics,
    Samples,
    StateChange,
)
from schemas.jobs import Error
from schemas.job_status import TERMINAL_STATES, JobQuery, JobReply
from services import bus
from services.aio import cancel_and_wait
from services.cli.client import CommandFailed
from services.cli.printable import NO_ANSWER, printable, readable

_dec = msgspec.json.Decoder(JobEvent)
_enc = msgspec.json.Encoder()
WAITING_POLL_S = 2.0  # how often `watch` asks a queued job why it waits


def progress_line(p: Progress) -> str:
    width = 30
    done = int(width * p.step / p.steps) if p.steps else 0
    bar = "#" * done + "-" * (width - done)
    parts = [f"[{bar}] {p.step}/{p.steps}"]
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4f}")
    if p.eval_loss is not None:
        parts.append(f"eval {p.eval_loss:.4f}")
    if p.eval_reward is not None:
        parts.append(f"eval reward {p.eval_reward:.3f}")
    if p.reinforcement is not None:
        parts.append(reinforcement_part(p.reinforcement))
    if p.lr is not None:
        parts.append(f"lr {p.lr:.2e}")
    if p.tokens_per_s:
        parts.append(f"{p.tokens_per_s:,.0f} tok/s")
    if p.eta_s is not None:
        parts.append(f"ETA {p.eta_s:.0f}s")
    if p.peak_mib is not None:
        parts.append(f"peak {p.peak_mib:,.0f} MiB")
    return "  ".join(parts)


def reinforcement_part(r: ReinforcementMetrics) -> str:
    """grpo's figures: the reward (each grader's where there are several), pass rate, KL, lengths, speed."""
    parts = [f"reward {r.reward:.3f}±{r.reward_std:.3f}"]
    if len(r.graders) > 1:
        parts.append("(" + ", ".join(f"{name} {s.mean:.3f}" for name, s in r.graders.items()) + ")")
    parts.append(f"pass {r.pass_rate:.0%}")
    if r.kl is not None:
        parts.append(f"kl {r.kl:.4f}")
    parts.append(f"{r.completion_tokens:.0f} tok/completion  {r.rollouts_per_s:.1f} rollouts/s")
    if r.grading_failures:
        parts.append(f"{r.grading_failures} grading failures")
    return " ".join(parts)


def samples_lines(ev: Samples) -> str:
    who = "base model" if ev.model == "base" else f"adapter at step {ev.step}"
    return "\n".join(
        f"  [{who}] {s.prompt!r} -> {shown_answer(ev, s.answer)}"
        + ("" if s.score is None else f"  score {s.score:.3f}")
        for s in ev.samples
    )


def shown_answer(ev: Samples, text: str) -> str:
    """An answer quoted as it is, but a base model's that is no text (random weights answer with bytes)."""
    return NO_ANSWER if ev.model == "base" and not readable(text) else repr(text.strip())


def describe(ev) -> str:
    """One event as a line (samples: a line per prompt)."""
    if isinstance(ev, Progress):
        return progress_line(ev)
    if isinstance(ev, Preparing):
        return printable(ev.message)
    if isinstance(ev, Samples):
        return "samples:\n" + printable(samples_lines(ev), one_line=False)
    by = f" (by {printable(ev.paused_by)})" if ev.state == "paused" and ev.paused_by else ""  # a preemption says who
    return f"{ev.state}: {printable(ev.message)}{by}"


async def follow(nc: Client, job: str, tenant: str | None = None):
    """Yield the job's events, replayed from its first, until a terminal state. An admin replays the JOBS
    stream with a consumer; a tenant, who may not, replays through its events API and follows its own subjects."""
    names.check_token(job, "job id")
    source = _follow_stream(nc, job) if tenant is None else _follow_as_tenant(nc, job, names.check_tenant(tenant))
    async for ev in source:
        yield ev
        if isinstance(ev, StateChange) and ev.state in TERMINAL_STATES:
            return


async def _follow_stream(nc: Client, job: str):
    sub = await nc.jetstream().subscribe(names.job_events(job), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        async for msg in sub.messages:
            try:
                yield _dec.decode(msg.data)
            except msgspec.DecodeError:
                continue
    finally:
        await sub.unsubscribe()


async def _follow_as_tenant(nc: Client, job: str, tenant: str):
    """Subscribe first (core NATS, jetlora.job.<tenant>.<job>.>), then page through the history the scheduler
    vouches for, then the live events the pages had not reached; live events only from the node running it."""
    api = names.jobs_api(tenant)
    live = await nc.subscribe(names.job_events(job, tenant))
    try:
        seen: set[bytes] = set()
        holders: set[str] = set()
        after, more = 0, True
        while more:
            page = await bus.request(nc, api.events, EventsQuery(job=job, after=after, limit=1000), EventPage | Error)
            if isinstance(page, Error):
                raise CommandFailed(page.error)
            for entry in page.events:
                seen.add(_enc.encode(entry.event))
                holders.add(entry.node)
                yield entry.event
            after, more = page.next, page.more
        async for msg in live.messages:
            try:
                ev = _dec.decode(msg.data)
            except msgspec.DecodeError:
                continue
            node = subject_parts.job_and_node_of_subject(msg.subject)[1]
            if _enc.encode(ev) in seen or not await _holds(nc, api, job, node, holders):
                continue
            yield ev
    finally:
        await live.unsubscribe()


async def _holds(nc: Client, api: names.JobsApi, job: str, node: str, holders: set[str]) -> bool:
    """Whether `node` runs (or ran) the job, as the scheduler says; asked again only for a node not seen yet."""
    if node not in holders:
        reply = await bus.request(nc, api.job, JobQuery(job), JobReply | Error)
        if isinstance(reply, JobReply) and reply.job.node == node:
            holders.add(node)
    return node in holders


async def _say_why_it_waits(nc: Client, job: str, tenant: str | None) -> None:
    """While the job is queued (no events yet), print why it waits each time the reason changes."""
    said = ""
    while True:
        reply = await bus.request(nc, names.jobs_api(tenant).job, JobQuery(job), JobReply | Error)
        if not isinstance(reply, JobReply) or reply.job.state != "queued":
            return
        if reply.job.message != said:
            said = reply.job.message
            print(f"queued: {printable(said)}", flush=True)
        await asyncio.sleep(WAITING_POLL_S)


async def watch(nc: Client, job: str, as_json: bool = False, tenant: str | None = None) -> int:
    tty = sys.stdout.isatty() and not as_json
    waiting = None if as_json else asyncio.create_task(_say_why_it_waits(nc, job, tenant))
    try:
        return await _print_events(nc, job, as_json, tenant, tty, waiting)
    finally:
        await cancel_and_wait([waiting])


async def _print_events(nc: Client, job: str, as_json: bool, tenant: str | None, tty: bool, waiting) -> int:
    last = None
    async for ev in follow(nc, job, tenant):
        if waiting is not None and not waiting.done():
            waiting.cancel()  # it moves: the events say the rest
        if as_json:
            print(msgspec.json.encode(ev).decode(), flush=True)
        elif isinstance(ev, Progress):
            print(("\r" if tty else "") + progress_line(ev), end="" if tty else "\n", flush=True)
        elif isinstance(ev, Preparing):
            print(("\r" if tty else "") + ev.message, end="" if tty else "\n", flush=True)
        else:
            print(("\n" if tty else "") + describe(ev), flush=True)
        last = ev
    return 0 if isinstance(last, StateChange) and last.state in ("succeeded", "stopped") else 1
