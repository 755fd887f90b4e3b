"""grpo's completions sampled by the node's co-located vLLM instead of the trainer (train.rollouts engine or auto).

After every optimizer step the adapter is saved (PEFT's layout, as a plain LoRA of the base) and loaded into the
engine under a name of the job's own, `jetlora-rl-<job>-<attempt>` (never a name the fleet serves; `load_inplace`
after the first load), and the engine's greedy answer to the probe prompt is compared with the trainer's. Each
prompt's group is then one completions request: the prompt as the trainer's token ids, n = group_size, plain
sampling at the job's temperature, the completion's token ids sent back, at a lower priority than live traffic
where the engine schedules by priority; the requests go out together (threads), each with a timeout. The batch
the loss sees is built from the engine's tokens, laid out as trainer/objectives/rollouts.py lays out the trainer's own.

Versions: version v is the adapter after v optimizer steps, and step v + 1 learns from completions of version v.
The engine serves v when its greedy probe answer agrees with the trainer's at v (at least its first
PROBE_HEAD_TOKENS tokens, what holds across precisions) and the log-probabilities of those tokens are no nearer
the trainer's at v - 1 than at v. The probe is asked again after a group is sampled: completions sampled while the
engine served another version are counted stale and dropped, then sampled again after a new sync (once; after that,
or when the engine fails, the trainer samples the step itself, counted as fallback). Two versions whose probe
answers and log-probabilities agree cannot be told apart this way: the policy is the same on the probe, not
necessarily elsewhere.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from schemas.events import ENGINE_WAIT, RolloutEngine
from schemas.job_status import PROBE_HEAD_TOKENS, PROBE_PROMPT, PROBE_TOKENS
from trainer.errors import JobError
from trainer.objectives.grpo import token_logps
from trainer.objectives.rft import Prompts
from trainer.objectives.rollouts import (
    Rollout,
    complete,
    eos_ids,
    evaluating,
    grade,
    group_advantages,
    pad_id,
    rollout,
    texts_of,
)

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

NAME_PREFIX = "jetlora-rl"
REQUEST_TIMEOUT_S = 600.0  # a group's request: long enough to wait behind live traffic at a lower priority
LOAD_TIMEOUT_S = 120.0


class EngineFailed(Exception):
    """The engine did not answer as asked (refused, unreachable, timed out)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Fingerprint:
    """A greedy answer to the probe prompt: its tokens and their log-probabilities (temperature 1)."""

    tokens: tuple[int, ...]
    logps: tuple[float, ...]


def post(url: str, body: dict, timeout: float) -> str:
    """The answer's text to a JSON POST; EngineFailed for an error status or no answer."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")[:300]
        raise EngineFailed(f"POST {url}: HTTP {e.code}: {text}", e.code) from None
    except OSError as e:
        raise EngineFailed(f"POST {url}: no answer ({e})") from None


def serves(engine: Fingerprint, now: Fingerprint, before: Fingerprint | None) -> bool:
    """Whether the engine's probe answer is the trainer's at this version rather than the previous one's."""
    agreed = _common(engine.tokens, now.tokens)
    if agreed < min(PROBE_HEAD_TOKENS, len(now.tokens)):
        return False
    if before is None or _common(engine.tokens, before.tokens) < agreed:
        return True
    return _distance(engine, now, agreed) <= _distance(engine, before, agreed)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _distance(a: Fingerprint, b: Fingerprint, n: int) -> float:
    return max((abs(x - y) for x, y in zip(a.logps[:n], b.logps[:n])), default=0.0)


def layout(prompts: list[list[int]], completions: list[list[int]], eos: list[int], pad: int):
    """(input_ids, attention_mask, completion_mask) as trainer/rollouts.complete lays out generate's output: each
    prompt left-padded, its completion right-padded, the completion's mask through its first end token."""
    width = max(len(p) for p in prompts)
    cut = [next((i + 1 for i, t in enumerate(c) if t in eos), len(c)) for c in completions]
    span = max(max(len(c) for c in completions), 1)
    ids = torch.full((len(prompts), width + span), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width + span), dtype=torch.long)
    completion_mask = torch.zeros((len(prompts), span), dtype=torch.long)
    for n, (p, c) in enumerate(zip(prompts, completions)):
        ids[n, width - len(p) : width], mask[n, width - len(p) : width] = torch.tensor(p), 1
        if c:
            ids[n, width : width + len(c)] = torch.tensor(c)
        completion_mask[n, : cut[n]] = 1
    return ids, torch.cat([mask[:, :width], completion_mask], dim=1), completion_mask


@dataclass
class EngineStats:
    """Since the last report: syncs and their seconds, what the engine sampled, what was stale, what fell back."""

    sync_seconds: list[float] = field(default_factory=list)
    sampled: int = 0
    stale: int = 0
    fallback: int = 0

    def report(self) -> dict:
        seen = self.sampled + self.stale
        return dict(
            sync_s=sum(self.sync_seconds) / len(self.sync_seconds) if self.sync_seconds else None,
            syncs=len(self.sync_seconds),
            stale_rollouts=self.stale,
            stale_share=self.stale / seen if seen else None,
            fallback_rollouts=self.fallback,
            sampled_by="both" if self.fallback and self.sampled else "trainer" if self.fallback else "engine",
        )


class EngineRollouts:
    """One job's rollouts through one engine: `rollouts()` per step, `report()` per progress event."""

    def __init__(
        self, engine: RolloutEngine, spec, tokenizer: PreTrainedTokenizerBase, device: str, save, context, strict: bool
    ) -> None:
        self.url, self.priority = engine.url.rstrip("/"), engine.priority
        self.name = f"{NAME_PREFIX}-{spec.job}-{spec.attempt}"
        self.root = Path(spec.out_dir) / "engine-adapter"
        self.flag = Path(spec.out_dir) / ENGINE_WAIT  # there while the trainer waits on the engine (the agent reads it)
        self.train, self.tokenizer, self.device, self.context = spec.request.train, tokenizer, device, context
        self.save, self.strict = save, strict  # save(model, dir) writes a plain PEFT LoRA of the base
        self.probe_ids: list[int] = tokenizer(PROBE_PROMPT)["input_ids"]
        self.version: int | None = None  # the version the engine was last confirmed to serve
        self.mine: dict[int, Fingerprint] = {}  # the trainer's probe answer at the last two versions
        self.loaded = False
        self.off = ""  # why the engine is not asked any more (train.rollouts auto, after it refused the adapter)
        self.eos: list[int] = []  # the ids that end a completion, as the trainer's generate takes them
        self.stats = EngineStats()

    def rollouts(self, model: PeftModel, batches: list[Prompts], step: int) -> list[Rollout]:
        """Each micro-batch's groups, sampled by the engine at version `step` (or by the trainer, counted)."""
        self.eos = self.eos or eos_ids(model, self.tokenizer)
        return [self._one(model, prompts, step) for prompts in batches]

    def _one(self, model: PeftModel, prompts: Prompts, step: int) -> Rollout:
        for _ in range(0 if self.off else 2):
            try:
                self.sync(model, step)
                batch = self.sample(prompts, step)
            except EngineFailed as e:
                self._failed(e)
                break
            if batch is not None:
                return batch
            self.version = None  # stale: the engine serves something else now; load the adapter again
        batch = rollout(model, self.tokenizer, prompts, self.train, self.context, self.device)
        batch.version = step
        self.stats.fallback += len(batch.texts)
        return batch

    def _failed(self, e: EngineFailed) -> None:
        """A refused first load ends the job under train.rollouts engine, and the engine's use under auto; anything
        else: the trainer samples this step."""
        refused = not self.loaded and 400 <= e.status < 500
        if refused and self.strict:
            raise JobError(
                f"train.rollouts is engine, and the node's vLLM refused the job's adapter ({e}); it needs "
                "--enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and a --max-lora-rank of at least lora.r: "
                "fix the engine, or set train.rollouts to trainer or auto"
            )
        if refused:
            self.off = f"the node's vLLM refused the adapter ({e})"
        said = "; the trainer samples from now on" if refused else "; the trainer samples this step"
        print(f"engine rollouts: {e}{said}", file=sys.stderr, flush=True)
        self.version = None

    def sync(self, model: PeftModel, step: int) -> None:
        """Make the engine serve version `step` under the job's name, confirmed by the probe."""
        if self.version == step:
            return
        start = time.monotonic()
        target = self.root / f"step-{step}"
        self.save(model, target)
        body = {"lora_name": self.name, "lora_path": str(target)} | ({"load_inplace": True} if self.loaded else {})
        with self.waiting():
            post(f"{self.url}/v1/load_lora_adapter", body, LOAD_TIMEOUT_S)
        if not self.loaded:
            self.loaded = True
            atexit.register(self.close)
        self.mine = {v: f for v, f in self.mine.items() if v == step - 1}
        self.mine[step] = self.trainer_fingerprint(model)
        theirs = self.engine_fingerprint()
        if not serves(theirs, self.mine[step], self.mine.get(step - 1)):
            raise EngineFailed(
                f"after loading step {step}'s adapter the engine answers the probe with tokens {list(theirs.tokens)} "
                f"where the trainer answers {list(self.mine[step].tokens)}"
            )
        self.version = step
        for old in self.root.glob("step-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        self.stats.sync_seconds.append(time.monotonic() - start)

    @torch.no_grad()
    def trainer_fingerprint(self, model: PeftModel) -> Fingerprint:
        """The trainer's greedy answer to the probe, and its tokens' log-probabilities."""
        with evaluating(model):
            ids, attention, completion_mask = complete(
                model, self.tokenizer, [self.probe_ids], PROBE_TOKENS, None, self.device
            )
            batch = Rollout(ids, attention, completion_mask, torch.zeros(1), [], [], 0.0).to(self.device)
            logps = token_logps(model, batch, 1.0, torch.float32, 0)[0].cpu()
        keep = completion_mask[0].bool()
        tokens = ids[0, -keep.shape[0] :][keep]
        return Fingerprint(tuple(tokens.tolist()), tuple(logps[keep].tolist()))

    def engine_fingerprint(self) -> Fingerprint:
        """The engine's greedy answer to the probe under the job's name, and its tokens' log-probabilities."""
        body = dict(self._request(self.probe_ids, 1, PROBE_TOKENS), temperature=0.0, logprobs=1)
        with self.waiting():
            choice = json.loads(post(f"{self.url}/v1/completions", body, REQUEST_TIMEOUT_S))["choices"][0]
        tokens = self._tokens(choice)
        logps = (choice.get("logprobs") or {}).get("token_logprobs") or []
        cut = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        return Fingerprint(tuple(tokens[:cut]), tuple(float(x) for x in logps[:cut]))

    def sample(self, prompts: Prompts, step: int) -> Rollout | None:
        """Each prompt's group through the engine, graded; None when the engine served another version by the end
        (the completions are counted stale and dropped)."""
        start, g, t = time.monotonic(), self.train.group_size, self.train
        with self.waiting(), ThreadPoolExecutor(max_workers=min(len(prompts), 32)) as pool:
            answers = list(pool.map(self._group, prompts.ids))
        if not serves(self.engine_fingerprint(), self.mine[step], self.mine.get(step - 1)):
            self.stats.stale += sum(len(a) for a in answers)
            return None
        repeated = [ids for ids in prompts.ids for _ in range(g)]
        completions = [c for group in answers for c in group]
        input_ids, attention_mask, completion_mask = layout(repeated, completions, self.eos, pad_id(self.tokenizer))
        texts = texts_of(self.tokenizer, input_ids, completion_mask)
        results = grade(t.grader, texts, [item for item in prompts.items for _ in range(g)], self.context)
        rewards = torch.tensor([r.score for r in results], dtype=torch.float32)
        self.stats.sampled += len(completions)
        batch = Rollout(input_ids, attention_mask, completion_mask, group_advantages(rewards, g), texts, results, 0.0)
        batch.seconds, batch.version = time.monotonic() - start, step
        return batch

    def _group(self, ids: list[int]) -> list[list[int]]:
        t = self.train
        body = dict(self._request(ids, t.group_size, t.max_completion_tokens), temperature=t.temperature)
        answer = json.loads(post(f"{self.url}/v1/completions", body, REQUEST_TIMEOUT_S))
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != t.group_size:
            raise EngineFailed(f"asked for {t.group_size} completions, the engine sent {len(choices)}")
        return [self._tokens(c, ids) for c in choices]

    def _request(self, ids: list[int], n: int, max_tokens: int) -> dict:
        """A completions request: the prompt as token ids, plain sampling (no top-k, top-p, min-p or penalties),
        the completion's token ids sent back; rollouts' priority where the engine schedules by it."""
        body = dict(
            model=self.name,
            prompt=ids,
            n=n,
            max_tokens=max_tokens,
            top_p=1.0,
            top_k=-1,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            return_token_ids=True,
        )
        return body | ({"priority": self.priority} if self.priority else {})

    def _tokens(self, choice: dict, prompt: list[int] | None = None) -> list[int]:
        if choice.get("token_ids") is None:
            raise JobError(
                "the node's vLLM sends no completion token ids (return_token_ids, vLLM 0.10.2 and later): upgrade it, "
                "or set train.rollouts to trainer"
            )
        if prompt is not None and choice.get("prompt_token_ids") not in (None, prompt):
            raise EngineFailed("the engine answered another prompt than the token ids it was sent")
        return [int(t) for t in choice["token_ids"]]

    @contextlib.contextmanager
    def waiting(self):
        """While the trainer waits on the engine, computing nothing: the agent does not stop it for the engine's
        requests then (some are its own), only once it computes again."""
        self.flag.parent.mkdir(parents=True, exist_ok=True)
        self.flag.touch()
        try:
            yield
        finally:
            self.flag.unlink(missing_ok=True)

    def report(self) -> dict:
        """ReinforcementMetrics' engine fields over the window, which starts again."""
        out, self.stats = self.stats.report(), EngineStats()
        return out

    def close(self) -> None:
        """Unload the job's name from the engine (at the end, or at exit)."""
        if not self.loaded:
            return
        self.loaded = False
        try:
            post(f"{self.url}/v1/unload_lora_adapter", {"lora_name": self.name}, 30.0)
        except EngineFailed as e:
            print(f"engine rollouts: could not unload {self.name}: {e}", file=sys.stderr, flush=True)
        shutil.rmtree(self.root, ignore_errors=True)
