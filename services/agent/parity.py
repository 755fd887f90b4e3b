"""Train/serve parity on a node (schemas/parity.py): once an engine has loaded a version and answered its probe, it is
asked for the probe set's per-token log-probabilities under the adapter's name, and under its base model's name for
the floor. vLLM through its completions API's `logprob_token_ids` at each prefix of the trainer's token ids;
llama-cpp-python's server through `echo` with `logprobs` (the text sent; a text it tokenizes otherwise than the
trainer is left out, and said so). llama-server applies its adapter to every request, so its base is read while it
serves no adapter (before the first is loaded into it, or after a retire) and kept for the versions after."""

from __future__ import annotations

import json
import logging

from schemas.parity import ParityFigures, ParityText, deltas, describe, figures
from schemas.registry import AdapterVersion, NodeState
from services.agent.engine_http import EngineHttp
from services.agent.engines import Engine, EngineError, post_json

log = logging.getLogger(__name__)
LogProbs = list[float | None]  # per token after the first, lined up with ParityText.adapter; None: not scored


async def _ask(engine: Engine, body: dict, http: EngineHttp) -> dict:
    code, text = await post_json(f"{engine.url}/v1/completions", body, http=http)
    if code != 200:
        raise EngineError(f"a completion under {body['model']} failed ({code}): {text[:300]}")
    return json.loads(text)


async def _vllm(engine: Engine, name: str, t: ParityText, http: EngineHttp) -> tuple[LogProbs | None, str]:
    """vLLM scores the trainer's own tokens at generated positions: one prompt per prefix ids[:i], each asked for the
    log-probability of ids[i] (`logprob_token_ids`, keyed `token_id:N`). Not `prompt_logprobs`: with LoRA, vLLM's
    prompt-logprobs path maps adapters per request, not per token, which on CPU kills the engine when another
    request shares the batch (vllm-project/vllm#29955, #16668) and drops an lm_head delta (#51594)."""
    body = {
        "model": name,
        "prompt": [t.ids[:i] for i in range(1, len(t.ids))],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "logprob_token_ids": sorted(set(t.ids[1:])),
        "return_tokens_as_token_ids": True,
    }
    choices = sorted((await _ask(engine, body, http))["choices"], key=lambda c: c["index"])
    if len(choices) != len(t.ids) - 1:
        raise EngineError(f"asked {len(t.ids) - 1} prefixes under {name}, it answered {len(choices)}")
    out: LogProbs = []
    for choice, token in zip(choices, t.ids[1:]):
        top = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0] or {}
        found = top.get(f"token_id:{token}")
        out.append(None if found is None else float(found))
    return out, ""


async def _echo(engine: Engine, name: str, t: ParityText, http: EngineHttp) -> tuple[LogProbs | None, str]:
    """llama-cpp-python's server scores the text it tokenizes itself, echoed: its log-probabilities line up with the
    prompt's tokens only after a leading BOS, which it leaves out, and it gives none for the token after it."""
    if not t.bos:
        return None, "the model has no BOS, after which llama-cpp-python's echoed log-probabilities line up"
    body = {
        "model": name,
        "prompt": t.prompt,
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 0,
        "repeat_penalty": 1.0,
    }
    reply = await _ask(engine, body, http)
    if (reply.get("usage") or {}).get("prompt_tokens") != len(t.ids):
        return None, f"it tokenizes {t.prompt[:24]!r}... into other tokens than the trainer"
    scored = (reply["choices"][0].get("logprobs") or {}).get("token_logprobs")
    if not isinstance(scored, list) or len(scored) < len(t.ids) - 1:
        raise EngineError(f"asked to echo log-probabilities under {name}, it gave {str(scored)[:120]}")
    return [None if v is None else float(v) for v in scored[: len(t.ids) - 1]], ""


async def engine_logprobs(engine: Engine, name: str, t: ParityText, http: EngineHttp) -> tuple[LogProbs | None, str]:
    """The engine's log-probabilities of the text's tokens under `name`, or (None, why) where it cannot line them up
    with the trainer's; raises EngineError (or OSError) where it does not answer with them."""
    return await (_echo if engine.kind == "llamacpp" else _vllm)(engine, name, t, http)


class ParityCheck:
    """A node's parity checks, and what each llama.cpp engine answered as its base model alone."""

    def __init__(self, http: EngineHttp) -> None:
        self.http = http
        self.bases: dict[str, dict[str, LogProbs | None]] = {}  # llama.cpp engine label -> prompt -> log-probs

    async def note_base(self, engine: Engine, version: AdapterVersion) -> None:
        """llama.cpp, serving no adapter now: read its base model's log-probabilities of the version's probe set."""
        texts = version.probe.parity if version.probe else None
        if engine.kind != "llamacpp" or not engine.url or not texts:
            return
        try:
            read = {t.prompt: (await engine_logprobs(engine, engine.model, t, self.http))[0] for t in texts}
        except (OSError, EngineError, ValueError, KeyError, IndexError) as e:
            log.warning("parity: %s's base model could not be read (%s); no floor for it yet", engine.label, e)
            return
        self.bases.setdefault(engine.label, {}).update(read)

    async def _floor_of(self, engine: Engine, texts: list[ParityText]) -> tuple[dict[str, LogProbs | None], str]:
        if engine.kind == "llamacpp":
            if engine.label not in self.bases:
                return {}, "no floor: llama-server serves its adapter on every request, and was not read serving none"
            return self.bases[engine.label], ""
        try:
            return {t.prompt: (await engine_logprobs(engine, engine.model, t, self.http))[0] for t in texts}, ""
        except (OSError, EngineError, ValueError, KeyError, IndexError) as e:
            return {}, f"no floor: the base model under {engine.model!r} did not answer ({str(e)[:160]})"

    async def measure(self, engine: Engine, version: AdapterVersion) -> ParityFigures | None:
        """The engine's figures for this version; None for a version with no probe set (registered before parity)."""
        texts = version.probe.parity if version.probe else None
        if not texts:
            return None
        bases, note = await self._floor_of(engine, texts)
        adapter: list[float] = []
        floor: list[float] = []
        left: list[str] = []
        for t in texts:
            theirs, why = await engine_logprobs(engine, version.name, t, self.http)
            if theirs is None:
                left.append(why)
                continue
            adapter += deltas(t.adapter, theirs)
            if t.base is not None and (base := bases.get(t.prompt)) is not None:
                floor += deltas(t.base, base)
        if left:
            note = "; ".join([note] * bool(note) + [f"{len(left)} of {len(texts)} texts left out: {left[0]}"])
        return figures(adapter, floor or None, engine.parity_factor, engine.parity_epsilon, note)

    async def judged(
        self, engine: Engine, version: AdapterVersion, state: NodeState, said: str
    ) -> tuple[NodeState, str, ParityFigures | None]:
        """The verdict with parity: a version beyond its limit is a mismatch, whatever its probe answered; the
        figures go with either. An engine that gives no log-probabilities leaves the verdict as it was, said so."""
        if state not in ("loaded", "mismatch"):
            return state, said, None
        try:
            found = await self.measure(engine, version)
        except (OSError, EngineError, ValueError, KeyError, IndexError) as e:
            return state, f"{said}; parity not measured: {str(e)[:300]}", None
        if found is None:
            return state, said, None
        if found.within is False:
            return (
                "mismatch",
                (
                    f"{said}; its log-probabilities are not its trainer's, beyond {engine.parity_factor:g} x the "
                    f"floor + {engine.parity_epsilon:g}: the engine computes something other than the trained "
                    f"adapter under this name (its scaling, its modules, or other files); {describe(found)}"
                ),
                found,
            )
        return state, f"{said}; {describe(found)}", found
