"""Follow a job's events from the start of the JOBS stream until it ends: the CLI's live view."""

from __future__ import annotations

import sys

import msgspec
from nats.aio.client import Client
from nats.js.api import DeliverPolicy

from schemas import names
from schemas.events import JobEvent, Preparing, Progress, Samples, StateChange
from schemas.jobs import TERMINAL_STATES
from services.cli.printable import printable

_dec = msgspec.json.Decoder(JobEvent)


def progress_line(p: Progress) -> str:
    width = 30
    done = int(width * p.step / p.steps) if p.steps else 0
    bar = "#" * done + "-" * (width - done)
    parts = [f"[{bar}] {p.step}/{p.steps}"]
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4f}")
    if p.eval_loss is not None:
        parts.append(f"eval {p.eval_loss:.4f}")
    if p.lr is not None:
        parts.append(f"lr {p.lr:.2e}")
    if p.tokens_per_s:
        parts.append(f"{p.tokens_per_s:,.0f} tok/s")
    if p.eta_s is not None:
        parts.append(f"ETA {p.eta_s:.0f}s")
    if p.peak_mib is not None:
        parts.append(f"peak {p.peak_mib:,.0f} MiB")
    return "  ".join(parts)


def samples_lines(ev: Samples) -> str:
    who = "base model" if ev.model == "base" else f"adapter at step {ev.step}"
    return "\n".join(f"  [{who}] {s.prompt!r} -> {s.answer.strip()!r}" for s in ev.samples)


def describe(ev) -> str:
    """One event as a line (samples: a line per prompt)."""
    if isinstance(ev, Progress):
        return progress_line(ev)
    if isinstance(ev, Preparing):
        return printable(ev.message)
    if isinstance(ev, Samples):
        return "samples:\n" + printable(samples_lines(ev), one_line=False)
    return f"{ev.state}: {printable(ev.message)}"


async def follow(nc: Client, job: str):
    """Yield the job's events, replayed from its first, until a terminal state."""
    names.check_token(job, "job id")
    js = nc.jetstream()
    sub = await js.subscribe(names.job_events(job), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        async for msg in sub.messages:
            try:
                ev = _dec.decode(msg.data)
            except msgspec.DecodeError:
                continue
            yield ev
            if isinstance(ev, StateChange) and ev.state in TERMINAL_STATES:
                return
    finally:
        await sub.unsubscribe()


async def watch(nc: Client, job: str, as_json: bool = False) -> int:
    tty = sys.stdout.isatty() and not as_json
    last = None
    async for ev in follow(nc, job):
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
