"""One tenant's jobs never decide another's outcome, on the real stack under `--co-train any` (nats-server,
scheduler, artifact service, an agent as a process with the real group trainer and a serving engine's metrics beside
it): tenant globex's job shares a group with four of tenant acme's, one diverging (NaN), one so large that the
group's step runs out of memory with it (a token budget the trainer enforces for tests, as a device would run out),
one cancelled, one paused; and the engine serves for a while, so every member yields. globex's job finishes each
time on the loss curve it has alone, with its own adapter, and nothing of acme's (job ids, tenant, rows) appears in
any of its events; the job that ran the step out of memory is handed back, nobody failing for it, and trains alone
once the group's device is free."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from schemas import names
from schemas.events import Progress, StateChange, TrainerSpec
from schemas.jobs import JobRequest, SubmitReply
from schemas.job_status import JobQuery, JobReply
from services.artifacts.service import ArtifactService
from services.scheduler.core import SchedulerConfig
from services.scheduler.service import Scheduler
from tests.conftest import stream_events, wait_for
from tests.qa import pairs
from tests.test_co_train_stack import ATTN, MLP, ask, ended, status
from tests.test_yielding import Metrics
from trainer.co_train.group import OOM_FAULT_ENV

pytestmark = pytest.mark.timeout(420)
TRAIN = {"learning_rate": 0.005, "batch_size": 1, "max_seq_length": 128, "precision": "fp16", "logging_steps": 1}
MARK = "zebracorn"  # in every one of acme's rows: it must never show in globex's events


def job(tiny_model, data: list[dict] | None = None, **kw) -> dict:
    train = {**TRAIN, **kw.pop("train", {})}
    rows = data or pairs()
    return {"model": "tiny", "base_dir": str(tiny_model), "data": rows, "accelerator": "cpu", "train": train, **kw}


def acmes(rows: list[dict]) -> list[dict]:
    return [{"q": r["q"], "a": f"{r['a']} {MARK}"} for r in rows]


async def test_one_tenants_jobs_never_decide_anothers(services, nc, agents, tiny_model, tmp_path):
    cfg = SchedulerConfig(co_train="any", heartbeat_interval=0.25, misses=8)
    sched, *_ = await services.start(lambda c: Scheduler(c, cfg))
    await services.start(lambda c: ArtifactService(c))
    await asyncio.wait_for(sched.leading.wait(), 10)
    engine = Metrics()
    try:
        await _run(nc, agents, tiny_model, tmp_path, engine)
    finally:
        engine.close()


async def _run(nc, agents, tiny_model, tmp_path, engine: Metrics) -> None:
    mine = job(tiny_model, lora={"r": 4, "alpha": 8, "target_modules": ATTN}, train={"max_steps": 60})
    theirs = {
        "nan": job(
            tiny_model,
            acmes(pairs()),
            lora={"r": 1, "alpha": 8192, "target_modules": ATTN + MLP},
            train={"max_steps": 30, "learning_rate": 1.0, "max_grad_norm": 0.0},
        ),
        "huge": job(tiny_model, acmes(pairs() * 6), train={"max_steps": 4, "batch_size": 64}),
        "cancelled": job(tiny_model, acmes(pairs()), lora={"r": 8, "target_modules": ATTN}, train={"max_steps": 400}),
        "paused": job(tiny_model, acmes(pairs()), lora={"r": 2, "target_modules": MLP}, train={"max_steps": 400}),
    }
    ids = {n: (await ask(nc, "acme", "submit", r, SubmitReply)).job for n, r in theirs.items()}
    b = (await ask(nc, "globex", "submit", mine, SubmitReply)).job
    agents.start(  # queued together before any node: placed in one group when it comes
        "box",
        gpus=None,
        offer_cpu=True,
        trainer=None,
        interval=0.25,
        env={OOM_FAULT_ENV: "1000"},  # globex's step holds at most 128 token positions, each of acme's but one too
        extra=("--engine", f"vllm={engine.url}", "--engine-model", "tiny", "--engine-yield", "compute,poll=0.05,holdoff=0.3"),
    )  # fmt: skip

    async def grouped(job_id: str, tenant: str):
        j = await status(nc, tenant, job_id)
        return j if j.group else None

    group = (await wait_for(lambda: grouped(b, "globex"), timeout=60, what="globex's job in a group")).group
    assert (await wait_for(lambda: grouped(ids["cancelled"], "acme"), timeout=60, what="acme's")).group == group

    await wait_for(lambda: _at(nc, "acme", ids["cancelled"], 2), timeout=120, what="acme's job to cancel under way")
    await ask(nc, "acme", "cancel", JobQuery(ids["cancelled"]), JobReply)
    await wait_for(lambda: _at(nc, "acme", ids["paused"], 2), timeout=120, what="acme's job to pause under way")
    await ask(nc, "acme", "pause", JobQuery(ids["paused"]), JobReply)
    engine.set(running=2, waiting=1)  # the engine serves: every member yields
    await wait_for(lambda: _says(nc, "globex", b, "yielding to vllm"), timeout=30, what="globex's job yielding")
    await asyncio.sleep(1.0)  # the engine's busy spell itself (what the job sits out), not a wait for a condition
    engine.set(running=0, waiting=0)

    done = await ended(nc, "globex", b, timeout=240)
    assert done.state == "succeeded" and done.attempt == 1, done.message
    assert [a.kind for a in done.artifacts][:1] == ["peft"] and all(b in a.name for a in done.artifacts), done.artifacts
    assert (await ended(nc, "acme", ids["cancelled"])).state == "cancelled"
    assert (await status(nc, "acme", ids["paused"])).state == "paused"
    nan = await ended(nc, "acme", ids["nan"])
    assert nan.state == "failed" and "nan" in nan.message.lower(), nan.message
    handed_back = [
        e for e in await stream_events(nc, names.job(ids["huge"], tenant="acme").state, _STATE) if e.state == "queued"
    ]
    assert handed_back and "ran out of memory" in handed_back[0].train_alone, handed_back  # it left; nobody failed
    alone = await ended(nc, "acme", ids["huge"], timeout=120)  # once the group's device is free: alone
    assert alone.state == "succeeded" and alone.attempt > 1 and alone.group is None, alone

    curve = {e.step: e.loss for e in await stream_events(nc, names.job(b, "box", tenant="globex").progress, _PROGRESS)}
    assert sorted(curve) == list(range(1, 61))
    assert [curve[s] for s in sorted(curve)] == pytest.approx(
        alone_curve(tiny_model, b, mine, tmp_path), abs=1e-5, rel=0
    )

    everything = await stream_events(nc, names.job_events(b), _RAW)  # every event of globex's job, every kind
    text = b"\n".join(bytes(e) for e in everything).decode()
    assert text and "acme" not in text and MARK not in text
    assert not [i for i in ids.values() if i in text], "an acme job's id in globex's events"
    assert "ran out of memory" not in text and "nan" not in done.message.lower()


async def _at(nc, tenant: str, job_id: str, step: int) -> bool:
    return (await status(nc, tenant, job_id)).step >= step


async def _says(nc, tenant: str, job_id: str, words: str) -> bool:
    return words in (await status(nc, tenant, job_id)).message


def alone_curve(tiny_model, job_id: str, request: dict, tmp_path) -> list[float]:
    """The job's per-step losses trained alone, as its group's process trains (fp16 on the CPU, no autocast)."""
    from trainer.co_train.group import CoTrainer
    from trainer.model import load

    spec = TrainerSpec(job=job_id, attempt=1, request=msgspec.convert(request, JobRequest), out_dir=str(tmp_path / "b"))
    tokenizer, model = load(str(tiny_model), "cpu", torch.float16)
    group = CoTrainer(model, tokenizer)
    alone = group.add_job(spec)
    group.run()
    return [r.loss for r in alone.history]


_PROGRESS = msgspec.json.Decoder(Progress)
_RAW = msgspec.json.Decoder(msgspec.Raw)
_STATE = msgspec.json.Decoder(StateChange)
