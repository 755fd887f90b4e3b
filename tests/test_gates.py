"""Gates, under fault injection: good adapters really trained on the QA pairs (the trainer's own train(), one process,
different seeds) and broken ones made from them (alpha wrong, A and B swapped, a target module dropped, lora_B
zeroed, rank truncated, the safetensors file corrupted, trained for another base, trained on shuffled answers). Each
is evaluated as an eval run evaluates (trainer/evaluate.py's evaluate_items, in-process) and decided by the code the
registry's gate decides by (schemas/gates.py: the paired bootstrap against the incumbent, here the base model, and the
margin): every good one passes, every broken one is blocked, one that cannot even be loaded refused as not evaluated.
Then two decisions end to end through the real stack: a job's `register.gate` promotes a good adapter after real eval
runs, and `jetlora adapters promote NAME@2 --gate` refuses a regressed one, with both scores and the interval."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from schemas import names
from schemas.evals import Criterion, EvalCreate, EvalJob, EvalReply
from schemas.gates import GateSpec, compare, unevaluated, verdict
from schemas.jobs import Accepted, Error
from schemas.registry import AdapterQuery, AdapterReply, PromoteRequest
from services import bus
from services.evals.service import EvalsService
from services.transfer.sender import upload_dataset
from tests.conftest import ROOT, spec_for, submit, tinymodel, wait_for, wait_nodes, wait_state
from tests.qa import QA_PAIRS
from tests.test_dataset_formats import data_file

GOOD = 10
TRAIN = {"max_steps": 60, "learning_rate": 0.02, "warmup_steps": 0, "precision": "fp32", "logging_steps": 100}
LORA = {"r": 8, "alpha": 16}  # every attention and MLP projection (the default targets)
MARGIN = 0.1  # a candidate must beat the base by this much on the eval's score
SAYS_ANSWER = {
    "type": "string_check",
    "name": "says_answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "ilike",
}
SHORT = {**TRAIN, "max_steps": 20, "batch_size": 1}  # enough to regress
ROTATED = [(q, QA_PAIRS[(i + 1) % len(QA_PAIRS)][1]) for i, (q, _) in enumerate(QA_PAIRS)]  # every answer wrong


def rft_rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}], "answer": a} for q, a in QA_PAIRS]


def train_adapter(base_dir: Path, out: Path, seed: int, pairs=QA_PAIRS, steps: int = TRAIN["max_steps"]) -> Path:
    """An SFT adapter trained by the trainer's own loop, in this process."""
    from schemas.training import LoraConfig
    from trainer import events
    from trainer.job.loop import train

    spec = spec_for(base_dir, out, **{**TRAIN, "max_steps": steps, "seed": seed})
    data = [{"q": q, "a": a} for q, a in pairs]
    request = msgspec.convert({**msgspec.to_builtins(spec.request), "data": data}, type(spec.request))
    request = msgspec.structs.replace(request, lora=msgspec.convert(LORA, LoraConfig))
    with events.muted():  # muting for good would silence every later in-process run of this pytest process
        return Path(train(msgspec.structs.replace(spec, request=request), None).adapter_dir)


# --- faults, each made from a good adapter's directory ------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def _edit_weights(d: Path, change) -> None:
    f = d / "adapter_model.safetensors"
    save_file(change(load_file(str(f))), str(f))


def alpha_wrong(factor: float):
    def make(src: Path, dst: Path) -> None:
        config = json.loads((src / "adapter_config.json").read_text())
        _edit_config(_copy(src, dst), lora_alpha=config["lora_alpha"] * factor)

    return make


def swapped(src: Path, dst: Path) -> None:
    """A and B swapped: A' = B^T, B' = A^T (the shapes permit only that), on every module."""

    def change(w: dict) -> dict:
        out = dict(w)
        for key in w:
            if ".lora_A." in key:
                b = key.replace(".lora_A.", ".lora_B.")
                out[key], out[b] = w[b].T.contiguous(), w[key].T.contiguous()
        return out

    _edit_weights(_copy(src, dst), change)


def dropped(module: str):
    def make(src: Path, dst: Path) -> None:
        _edit_weights(_copy(src, dst), lambda w: {k: v for k, v in w.items() if f".{module}." not in k})

    return make


def zeroed_b(src: Path, dst: Path) -> None:
    _edit_weights(_copy(src, dst), lambda w: {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in w.items()})


def truncated(rank: int):
    """The first `rank` of the rank's components kept (alpha scaled so alpha/r stays)."""

    def make(src: Path, dst: Path) -> None:
        d = _copy(src, dst)
        config = json.loads((d / "adapter_config.json").read_text())
        _edit_config(d, r=rank, lora_alpha=config["lora_alpha"] * rank / config["r"])
        _edit_weights(
            d,
            lambda w: {
                k: (v[:rank].contiguous() if ".lora_A." in k else v[:, :rank].contiguous()) for k, v in w.items()
            },
        )

    return make


def corrupted(how: str):
    def make(src: Path, dst: Path) -> None:
        f = _copy(src, dst) / "adapter_model.safetensors"
        data = bytearray(f.read_bytes())
        if how == "truncated":
            data = data[: len(data) // 2]
        elif how == "emptied":
            data = bytearray()
        elif how == "header":
            data[8:40] = b"\xff" * 32  # the JSON header's start
        else:
            data[:8] = (2**40).to_bytes(8, "little")  # a header length past the file
        f.write_bytes(bytes(data))

    return make


FAULTS = {
    "alpha x16": (alpha_wrong(16.0), 0),
    "alpha x-1": (alpha_wrong(-1.0), 1),
    "alpha /16": (alpha_wrong(1 / 16), 2),
    "A and B swapped": (swapped, 3),
    "A and B swapped (2)": (swapped, 4),
    "down_proj dropped": (dropped("down_proj"), 5),
    "mlp dropped": (dropped("mlp"), 6),
    "lora_B zeroed": (zeroed_b, 7),
    "lora_B zeroed (2)": (zeroed_b, 8),
    "rank 8 -> 1": (truncated(1), 9),
    "rank 8 -> 1 (2)": (truncated(1), 0),
    "rank 8 -> 2": (truncated(2), 1),
    "safetensors truncated": (corrupted("truncated"), 2),
    "safetensors header overwritten": (corrupted("header"), 3),
    "safetensors header length wrong": (corrupted("length"), 4),
    "safetensors emptied": (corrupted("emptied"), 5),
    "alpha x8": (alpha_wrong(8.0), 6),
}


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    """{label: (adapter dir, good?)}: GOOD trained on the pairs, the faults made from them, two trained for another
    base, two on shuffled answers."""
    tmp = tmp_path_factory.mktemp("gates")
    started = time.monotonic()
    good = [train_adapter(tiny_model, tmp / f"good{i}", seed=i) for i in range(GOOD)]
    other_base = tinymodel().build(
        tmp / "other-base", [f"{q} {a}" for q, a in QA_PAIRS], hidden=64, layers=2, vocab_size=400, seed=7
    )  # the same shapes, other weights: it loads without complaint
    made = {f"good {i}": (d, True) for i, d in enumerate(good)}
    for label, (make, source) in FAULTS.items():
        make(good[source], tmp / label.replace(" ", "_"))
        made[label] = (tmp / label.replace(" ", "_"), False)
    for i in range(2):
        other = train_adapter(other_base, tmp / f"other{i}", seed=i, steps=20)
        made[f"trained for another base {i}"] = (other, False)
        made[f"shuffled answers {i}"] = (
            train_adapter(tiny_model, tmp / f"shuffled{i}", seed=i, pairs=ROTATED, steps=30),
            False,
        )
    print(f"\n{len(made)} adapters made in {time.monotonic() - started:.1f}s")
    return made


def test_the_gate_blocks_every_broken_adapter_and_passes_every_good_one(fleet, tiny_model, tmp_path):
    from peft import PeftModel

    from trainer.evaluate import evaluate_items
    from trainer.model import load
    from trainer.objectives.rollouts import grader_context

    tokenizer, base = load(str(tiny_model), "cpu", torch.float32)
    items = data_file(tmp_path / "items.jsonl", "rft", rft_rows()).path
    job = EvalJob(eval="qa", run="r", criteria=[msgspec.convert({"grader": SAYS_ANSWER}, Criterion)])
    job.sampling.max_tokens = 16
    context = grader_context(str(tmp_path / "graders"))

    def evaluated(model):
        return evaluate_items(model.eval(), tokenizer, job, items, 128, context, "cpu")

    incumbent = evaluated(copy.deepcopy(base))
    decisions = {}
    for label, (adapter, _) in fleet.items():
        started = time.monotonic()
        try:
            mine = evaluated(PeftModel.from_pretrained(copy.deepcopy(base), str(adapter), is_trainable=False))
        except Exception as e:  # an eval run whose adapter does not load fails: the gate refuses it, saying so
            why = unevaluated(label, "candidate", f"{type(e).__name__}: {str(e)[:120]}")
            decisions[label] = (False, why, time.monotonic() - started)
            continue
        c = compare(mine, incumbent, eval="qa", candidate=label, incumbent="tiny")
        decisions[label] = (*verdict(c, MARGIN), time.monotonic() - started)
    for label, (passed, why, took) in decisions.items():
        print(f"{'PASS ' if passed else 'BLOCK'} {took * 1000:6.0f} ms  {label}: {why}")
    good = [label for label, (_, ok) in fleet.items() if ok]
    broken = [label for label, (_, ok) in fleet.items() if not ok]
    passed_good = [label for label in good if decisions[label][0]]
    blocked_broken = [label for label in broken if not decisions[label][0]]
    print(f"good passed {len(passed_good)}/{len(good)}, broken blocked {len(blocked_broken)}/{len(broken)}")
    assert len(good) >= 10 and len(broken) >= 20
    assert passed_good == good, [decisions[label][1] for label in good if label not in passed_good]
    assert blocked_broken == broken, [decisions[label][1] for label in broken if label not in blocked_broken]
    for label in broken:
        if label.startswith("safetensors"):
            assert "could not be evaluated" in decisions[label][1], decisions[label]


# --- end to end: the registry's gate, real eval runs ----------------------------------------------------------------
@pytest.fixture
async def evals(stack, services):
    service, *_ = await services.start(lambda c: EvalsService(c))
    await wait_for(service.ready.is_set, timeout=10, what="the evals service")
    return service


async def alias(nc):
    reply = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name="capitals"), AdapterReply | Error)
    return reply.alias if isinstance(reply, AdapterReply) else None


async def test_gates_end_to_end(nc, nats_server, evals, agents, tiny_model, tmp_path):
    agents.start("cpu", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    await upload_dataset(nc, "qa-rft", data_file(tmp_path / "rft.jsonl", "rft", rft_rows()).path)
    create = EvalCreate(name="qa", dataset="qa-rft", criteria=[msgspec.convert({"grader": SAYS_ANSWER}, Criterion)])
    create.sampling.max_tokens = 16
    assert isinstance(await bus.request(nc, names.evals_api().create, create, EvalReply | Error), EvalReply)
    base = {"model": "tiny", "base_dir": str(tiny_model), "accelerator": "cpu", "train": {**TRAIN, "batch_size": 1}}
    refused = await submit(
        nc, {**base, "data": [{"q": "a", "a": "b"}], "register": {"name": "x", "gate": {"eval": "qa"}}}
    )
    assert not isinstance(refused, Accepted) and refused.errors[0].field == "register.gate", refused

    gate = {"eval": "qa", "margin": MARGIN}
    first = await submit(
        nc,
        {
            **base,
            "data": [{"q": q, "a": a} for q, a in QA_PAIRS],
            "register": {"name": "capitals", "promote": True, "gate": gate},
        },
    )
    assert isinstance(first, Accepted), first
    done = await wait_state(nc, first.job, ("succeeded", "failed"), timeout=180)
    assert done.state == "succeeded", done.message
    started = time.monotonic()
    a = await wait_for(lambda: _decided(nc), timeout=240, interval=0.5, what="the first version's gate")
    print(f"\nregister.gate decided in {time.monotonic() - started:.1f}s: {a.last_gate}")
    assert a.current == 1 and a.last_gate.startswith("gate passed") and "tiny" in a.last_gate, a

    unknown = PromoteRequest(name="capitals", version=1, gate=GateSpec(eval="nope"))
    refused = await bus.request(nc, names.ADAPTERS.promote, unknown, AdapterReply | Error)
    assert isinstance(refused, Error) and refused.field == "gate.eval" and "no eval named nope" in refused.error

    second = await submit(
        nc, {**base, "data": [{"q": q, "a": a} for q, a in ROTATED], "register": {"name": "capitals"}, "train": SHORT}
    )
    assert isinstance(second, Accepted), second
    assert (await wait_state(nc, second.job, ("succeeded", "failed"), timeout=180)).state == "succeeded"
    await wait_for(lambda: _versions(nc, 2), timeout=30, what="capitals@2 registered")
    started = time.monotonic()
    cli = [sys.executable, "-m", "services.cli", "adapters", "promote", "capitals@2", "--gate", "qa"]
    proc = await asyncio.create_subprocess_exec(
        *cli, "--nats", nats_server.url, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )  # not subprocess.run: the services answering it run on this test's loop
    out, err = (b.decode() for b in await asyncio.wait_for(proc.communicate(), 300))
    print(f"adapters promote --gate decided in {time.monotonic() - started:.1f}s (exit {proc.returncode}):")
    print(err[-1500:])
    assert proc.returncode == 2, (out, err)
    assert "gate refused capitals@2" in err and "capitals@1" in err and "95% interval" in err, err
    assert (await alias(nc)).current == 1


async def _decided(nc):
    a = await alias(nc)
    return a if a is not None and a.gate is None and a.last_gate else None


async def _versions(nc, n: int) -> bool:
    reply = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name="capitals"), AdapterReply | Error)
    return isinstance(reply, AdapterReply) and len(reply.versions) >= n
