"""Gated canaries end to end (real nats-server; the registry and evals services in-process; agents as processes; each
node's engine a small real server speaking vLLM's LoRA, completions and chat APIs, tests/lora_engine.py):
`adapters promote capitals@2 --gate capq --canary 1` decides the gate on the trainer-side runs (stored here as the
evals service stores completed runs), then moves the name on n1 alone; n1's agent loads @2 into its engine, checks
its probe and parity, runs the eval's items through the engine under the served name, grades them and reports the
served score. An engine that answers as the trainer did finishes the canary to every node; one that serves regressed
answers, or whose log-probabilities are not the trainer's, is rolled back by the registry with the figures."""

from __future__ import annotations

import asyncio
import sys
import time

import msgspec
import pytest

from schemas import names
from schemas.evals import (
    Criterion,
    EvalCreate,
    EvalReply,
    EvalRun,
    EvalSummary,
    GraderSummary,
    ItemResult,
    Sampling,
    run_key,
)
from schemas.gates import GateSpec
from schemas.jobs import Error
from schemas.job_status import Probe
from schemas.parity import ParityText
from schemas.registry import AdapterReply, AdapterVersion, PromoteRequest
from services import bus
from services.registry.store import AdapterRegistry
from tests.conftest import ROOT, wait_for
from tests.lora_engine import LoraEngine
from tests.qa import QA_PAIRS
from tests.test_registry import serving, show
from tests.test_registry_lifecycle import peft_archive, stored
from tests.test_gates import SAYS_ANSWER

ITEMS = [{"question": q, "answer": a.split()[-1].rstrip(".")} for q, a in QA_PAIRS[:8]]  # Paris, Tokyo, ...
ANSWERS = {item["question"]: item["answer"] for item in ITEMS}
BASE_LOGPROB, ADAPTER_LOGPROB = -1.0, -0.5  # what the engines give every token (tests/lora_engine.py)


def right(messages: list[dict]) -> str:
    return f"The capital is {ANSWERS[messages[-1]['content']]}."


def half_wrong(messages: list[dict]) -> str:
    question = messages[-1]["content"]
    return right(messages) if list(ANSWERS).index(question) % 2 else "I do not know."


def probe(adapter_logprob: float) -> Probe:
    """The probe an engine answering ` capitals here` passes, with a parity text its trainer scored at
    `adapter_logprob` per token with the adapter (and BASE_LOGPROB without)."""
    text = ParityText(prompt="x", ids=[1, 2, 3, 4], bos=True, adapter=[adapter_logprob] * 3, base=[BASE_LOGPROB] * 3)
    return Probe(prompt="Hello", text=" capitals here", head=" capitals", dtype="float32", parity=[text])


def results(answer, correct: list[bool]) -> tuple[bytes, EvalSummary]:
    """An eval run's `eval` artifact (one line an item, then the summary) and its summary."""
    lines = []
    for i, (item, ok) in enumerate(zip(ITEMS, correct)):
        messages = [{"role": "user", "content": item["question"]}]
        lines.append(
            ItemResult(
                index=i,
                item=item,
                input=messages,
                outputs=[answer(messages)],
                scores={"says_answer": [1.0 if ok else 0.0]},
                errors={"says_answer": [""]},
                passed={"says_answer": [ok]},
            )
        )
    mean = sum(correct) / len(correct)
    summary = EvalSummary(
        items=len(ITEMS),
        samples=len(ITEMS),
        graders=[
            GraderSummary(
                name="says_answer",
                mean=mean,
                low=mean,
                high=mean,
                pass_rate=mean,
                passed=sum(correct),
                failed=len(ITEMS) - sum(correct),
                errored=0,
            )
        ],
    )
    return b"".join(msgspec.json.encode(line) + b"\n" for line in (*lines, summary)), summary


async def completed_run(nc, run: str, version: int, answer, correct: list[bool]) -> None:
    """A completed trainer-side run of eval capq on capitals@version, stored as the evals service stores one."""
    job = f"job-{run}"
    data, summary = results(answer, correct)
    file = await stored(nc, job, "eval", data)
    record = EvalRun(
        id=run,
        eval="capq",
        job=job,
        base_model="tiny",
        adapter="capitals",
        version=version,
        dataset="capitals-rft",
        state="completed",
        created=time.time(),
        results=file.name,
        sha256=file.sha256,
        summary=summary,
        sampling=Sampling(max_tokens=16),
    )
    kv = await nc.jetstream().key_value(names.EVALS_KV)
    await kv.put(run_key(None, run), msgspec.json.encode(record))


@pytest.fixture
async def fleet(nc, services, agents):
    """The registry and the evals service; eval capq (a string_check) with trainer-side runs of capitals@1 (half
    right) and @2 (all right); nodes n1 and n2, each with its own engine, serving capitals@1 verified."""
    from services.evals.service import EvalsService
    from services.registry.service import RegistryService

    registry, *_ = await services.start(lambda c: RegistryService(c))
    evals, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(lambda: registry.ready.is_set() and evals.ready.is_set(), timeout=10, what="the services")
    create = EvalCreate(name="capq", criteria=[msgspec.convert({"grader": SAYS_ANSWER}, Criterion)])
    made = await bus.request(nc, names.evals_api().create, create, EvalReply | Error)
    assert isinstance(made, EvalReply) or "exists" in made.error, made  # (the evals bucket outlives a test)
    await completed_run(nc, "evalrun_one", 1, half_wrong, [i % 2 == 1 for i in range(len(ITEMS))])
    await completed_run(nc, "evalrun_two", 2, right, [True] * len(ITEMS))
    engines = {node: await LoraEngine().start() for node in ("n1", "n2")}
    for node, engine in engines.items():
        engine.logprobs["capitals"] = ADAPTER_LOGPROB
        agents.start(node, gpus=None, extra=("--engine", f"vllm={engine.url}", "--engine-model", "tiny"))
    try:
        yield engines
    finally:
        for engine in engines.values():
            await engine.stop()


async def versions(nc, *probes: Probe) -> None:
    """capitals@1, @2, ... (each its own PEFT archive, its own probe), and @1 served verified on n1 and n2."""
    registry = AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))
    for n, p in enumerate(probes, 1):
        peft = await stored(nc, f"job-cap{n}", "peft", peft_archive(f"cap{n}"))
        draft = AdapterVersion(
            name="capitals", version=1, job=f"job-cap{n}", base_model="tiny", peft=peft, r=8, alpha=16,
            target_modules=["q_proj"], probe=p,
        )  # fmt: skip
        await registry.add_version(draft)
    assert isinstance(await promote(nc, 1), AdapterReply)
    await serving(nc, "capitals", {"n1": (1, "loaded"), "n2": (1, "loaded")})
    heard = "of the 2 nodes serving capitals is all of them"  # not refused as some not live
    await wait_for(lambda: _refused_with(nc, heard), what="the registry to hear n1 and n2")


async def promote(nc, version: int, **more) -> AdapterReply | Error:
    request = PromoteRequest(name="capitals", version=version, **more)
    return await bus.request(nc, names.ADAPTERS.promote, request, AdapterReply | Error)


async def _refused_with(nc, text: str) -> bool:
    reply = await promote(nc, 2, canary="2")
    return isinstance(reply, Error) and text in reply.error


async def gated_canary(nc) -> AdapterReply:
    reply = await promote(nc, 2, gate=GateSpec(eval="capq", base_dir="/models/tiny"), canary="1")
    assert isinstance(reply, AdapterReply) and reply.alias.gate is not None, reply
    assert reply.alias.gate.canary == "1" and reply.alias.current == 1
    return reply


async def ended(nc):
    """The alias once its gate and its canary have ended (None while either is under way)."""
    a = (await show(nc, "capitals")).alias
    return a if a.gate is None and a.canary is None and a.last_rollout else None


async def stage(nc) -> tuple:
    """Where the gate and the canary stand: it changes as they move on (the wait for their end follows it, so a
    loaded machine's slower evals get their time and a stuck canary fails as soon)."""
    shown = await show(nc, "capitals")
    a, gate = shown.alias, shown.alias.gate
    where = (gate.note, gate.candidate_run, gate.incumbent_run) if gate else None
    return where, a.canary, tuple((n.node, n.version, n.state, n.served is not None) for n in shown.nodes)


async def test_a_gated_canary_whose_engine_scores_as_the_trainer_is_promoted_everywhere(nc, fleet, nats_server):
    await versions(nc, probe(ADAPTER_LOGPROB), probe(ADAPTER_LOGPROB))
    for engine in fleet.values():
        engine.answers["capitals"] = right
    started = time.monotonic()
    cli = [sys.executable, "-m", "services.cli", "adapters", "promote", "capitals@2", "--gate", "capq", "--canary", "1"]
    proc = await asyncio.create_subprocess_exec(
        *cli, "--gate-base-dir", "/models/tiny", "--nats", nats_server.url, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = (b.decode() for b in await asyncio.wait_for(proc.communicate(), 60))
    print(f"\ngated canary passed in {time.monotonic() - started:.1f}s:\n{err}")
    assert proc.returncode == 0, (out, err)
    assert "gate passed" in err and "canary on n1" in err and "passed on n1" in err, err
    a = (await show(nc, "capitals")).alias
    assert a.current == 2 and a.canary is None and a.last_gate.startswith("gate passed"), a
    assert "served eval capq: n1 1.000, within trainer 1.000 [1.000, 1.000] +/- 0.05 on 8 items" in a.last_rollout
    await serving(nc, "capitals", {"n1": (2, "loaded"), "n2": (2, "loaded")})
    [n1] = [n for n in (await show(nc, "capitals")).nodes if n.node == "n1"]
    assert n1.served is not None and (n1.served.mean, n1.served.items, n1.served.agree) == (1.0, 8, 8), n1.served
    assert n1.served.graders == {"says_answer": 1.0} and n1.parity is not None and n1.parity.within
    chats = fleet["n1"].chats  # the eval's items, greedy, under the served name; n2 evaluated nothing
    assert len(chats) == 8 and {c["model"] for c in chats} == {"capitals"} and fleet["n2"].chats == []
    assert all(c["temperature"] == 0 and c["max_tokens"] == 16 for c in chats)
    assert sorted(c["messages"][-1]["content"] for c in chats) == sorted(ANSWERS)
    shown = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "adapters", "show", "capitals", "--nats", nats_server.url, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    text = (await shown.communicate())[0].decode()
    print(text)
    assert "served eval capq 1.000 over 8 items (says_answer 1.000; 8 answered as the trainer" in text, text


async def test_a_gated_canary_whose_engine_serves_regressed_answers_is_rolled_back_with_the_figures(nc, fleet):
    await versions(nc, probe(ADAPTER_LOGPROB), probe(ADAPTER_LOGPROB))
    fleet["n1"].answers["capitals"] = half_wrong  # n1's engine regressed: half the capitals wrong
    started = time.monotonic()
    await gated_canary(nc)
    a = await wait_for(lambda: ended(nc), timeout=30, what="the gated canary to end", progress=lambda: stage(nc))
    print(f"\nrolled back in {time.monotonic() - started:.1f}s: {a.last_rollout}")
    assert a.current == 1 and a.last_gate.startswith("gate passed"), a
    why = a.last_rollout
    assert why.startswith("canary of capitals@2 rolled back: node n1 served eval capq at 0.500 over 8 items"), why
    assert "outside the trainer-side 1.000 [1.000, 1.000] widened by 0.05 to [0.950, 1.050]" in why, why
    assert "says_answer 0.500 (trainer 1.000)" in why and "4 of 8 answered as the trainer" in why, why
    assert "parity: mean |Δ log p| 0 (max 0) over 3 tokens" in why and "e.g. item 0: served 'I do not know.'" in why
    await serving(nc, "capitals", {"n1": (1, "loaded"), "n2": (1, "loaded")})  # n1 back on @1; n2 never moved
    assert fleet["n2"].chats == []


async def test_a_gated_canary_whose_parity_is_beyond_bounds_is_rolled_back_with_the_figures(nc, fleet):
    await versions(nc, probe(ADAPTER_LOGPROB), probe(-0.25))  # @2's trainer scored other log-probabilities
    fleet["n1"].answers["capitals"] = right  # its answers would pass: parity alone rolls it back
    await gated_canary(nc)
    a = await wait_for(lambda: ended(nc), timeout=30, what="the gated canary to end", progress=lambda: stage(nc))
    print(f"\nrolled back: {a.last_rollout}")
    why = a.last_rollout
    assert a.current == 1 and why.startswith("canary of capitals@2 rolled back: node n1 reported mismatch"), why
    assert "parity: mean |Δ log p| 0.25 (max 0.25) over 3 tokens; base alone 0 (max 0); limit 0.01" in why, why
    assert fleet["n1"].chats == []  # a mismatch is not evaluated


async def test_a_gated_canary_that_cannot_be_evaluated_is_rolled_back_saying_why(nc, fleet):
    await versions(nc, probe(ADAPTER_LOGPROB), probe(ADAPTER_LOGPROB))
    fleet["n1"].answers["capitals"] = lambda messages: 1 / 0  # its chat completions fail (HTTP 500)
    await gated_canary(nc)
    a = await wait_for(lambda: ended(nc), timeout=30, what="the gated canary to end", progress=lambda: stage(nc))
    why = a.last_rollout
    assert a.current == 1 and why.startswith("canary of capitals@2 rolled back: node n1 reported failed"), why
    assert "its served eval capq could not be run: item" in why and "failed (500)" in why, why


def test_a_gated_canary_waits_for_each_nodes_served_score_of_its_own_eval_and_old_records_still_load():
    from schemas.registry import DECODERS, Alias, Canary, NodeAdapterStatus
    from schemas.served import ServedEval, ServedScore
    from services.registry.canary import outcome

    criteria = [msgspec.convert({"grader": SAYS_ANSWER}, Criterion)]
    e = ServedEval(
        eval="capq", run="evalrun_two", results="j/eval", sha256="0" * 64, criteria=criteria, sampling=Sampling(),
        items=8, mean=0.9, low=0.8, high=1.0,
    )  # fmt: skip
    now = time.time()
    alias = Alias(name="capitals", current=1, canary=Canary(version=2, nodes=["n1", "n2"], deadline=now + 60, eval=e))

    def node(name: str, mean: float | None, run: str = "evalrun_two") -> NodeAdapterStatus:
        served = None if mean is None else ServedScore(eval="capq", run=run, items=8, samples=8, mean=mean)
        return NodeAdapterStatus(
            name="capitals", version=2, node=name, engine="vllm x", state="loaded", served=served, seq=1
        )

    assert outcome(alias, [node("n1", 0.75), node("n2", None)], now) is None  # 0.75: within [0.75, 1.05]
    assert outcome(alias, [node("n1", 0.9), node("n2", 0.9, run="evalrun_old")], now) is None  # another run's
    passed, why = outcome(alias, [node("n1", 0.9), node("n2", 1.0)], now)
    assert passed and "served eval capq: n1 0.900, n2 1.000, within trainer 0.900 [0.800, 1.000]" in why, why
    passed, why = outcome(alias, [node("n1", 0.9), node("n2", 0.7)], now)
    assert not passed and "node n2 served eval capq at 0.700" in why and "to [0.750, 1.050]" in why, why
    passed, why = outcome(alias, [node("n1", 0.9), node("n2", None)], now + 61)
    assert not passed and "(n2 loaded, no served score yet)" in why, why

    from schemas.registry import AdapterReply as Reply
    from services.cli.adapters import describe

    shown = "\n".join(describe(Reply(alias=alias, versions=[], nodes=[node("n1", 0.9)])))
    assert "gated: each canary node runs eval capq (run evalrun_two's items) through its engine" in shown, shown
    assert "served eval capq 0.900 over 8 items (0 answered as the trainer; 0.0s) against trainer 0.900" in shown
    assert "+/- 0.05 on 8 items: within" in shown, shown

    before = b'{"name": "capitals", "current": 1, "canary": {"version": 2, "nodes": ["n1"], "deadline": 1.0}}'
    assert DECODERS["alias"].decode(before).canary.eval is None
    status = b'{"name": "capitals", "version": 2, "node": "n1", "engine": "vllm x", "state": "loaded"}'
    assert DECODERS["node"].decode(status).served is None
