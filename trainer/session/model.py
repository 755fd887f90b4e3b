"""What a training session does to its adapter: the forward (and backward) of a batch of datums under a Tinker loss,
AdamW steps with the caller's settings, saving and loading, and sampling with the log-probabilities the forward
gives (the same code computes both, so a sampler's log-probs and the trainer's agree exactly)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from schemas.sessions import (
    LOSSES,
    RECORDED_LOGPROBS,
    SAMPLED_MASK,
    Datum,
    ForwardBackward,
    OptimStep,
    Sample,
    SampledSequence,
)
from trainer.errors import JobError
from trainer.session.losses import column, loss_of

POLICY = ("target_tokens", "logprobs", "advantages")
NEEDS = {  # the inputs each loss reads from every datum (stable_reinforce's sampler log-probs come recorded)
    "cross_entropy": ("target_tokens",),
    **dict.fromkeys(LOSSES[1:], POLICY),
    "stable_reinforce": ("target_tokens", "advantages", RECORDED_LOGPROBS, SAMPLED_MASK),
}


class CallRefused(JobError):
    """A call the session cannot take as sent (nothing changed); `field` names what to change."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def check_batch(fb: ForwardBackward, vocab: int) -> None:
    """Refuse a batch whose loss or inputs do not fit, naming the datum and the input."""
    if fb.loss_fn not in LOSSES:
        raise CallRefused(f"loss_fn {fb.loss_fn!r} is not served here; use one of {', '.join(LOSSES)}", "loss_fn")
    if not fb.data:
        raise CallRefused("forward_backward needs at least one datum", "data")
    for i, d in enumerate(fb.data):
        if not d.tokens:
            raise CallRefused(f"data[{i}].model_input has no tokens", f"data[{i}].model_input")
        if max(d.tokens) >= vocab or min(d.tokens) < 0:
            raise CallRefused(
                f"data[{i}].model_input has a token outside the vocabulary (0..{vocab - 1})", f"data[{i}]"
            )
        for name in NEEDS[fb.loss_fn]:
            if name not in d.inputs:
                raise CallRefused(f"{fb.loss_fn} needs loss_fn_inputs[{name!r}] in data[{i}]", f"data[{i}].{name}")
        for name, values in d.inputs.items():
            if len(values) != len(d.tokens):
                raise CallRefused(
                    f"data[{i}].loss_fn_inputs[{name!r}] has {len(values)} values for {len(d.tokens)} input tokens: "
                    "each input is as long as model_input (position i's target follows token i)",
                    f"data[{i}].{name}",
                )
        if any(t < 0 or t >= vocab or t != int(t) for t in d.inputs["target_tokens"]):
            raise CallRefused(
                f"data[{i}].target_tokens holds a token outside 0..{vocab - 1}", f"data[{i}].target_tokens"
            )


def padded(data: list[Datum], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The datums' tokens as one right-padded batch, and its mask."""
    width = max(len(d.tokens) for d in data)
    ids = torch.zeros(len(data), width, dtype=torch.long)
    mask = torch.zeros(len(data), width, dtype=torch.long)
    for row, d in enumerate(data):
        ids[row, : len(d.tokens)] = torch.tensor(d.tokens)
        mask[row, : len(d.tokens)] = 1
    return ids.to(device), mask.to(device)


def target_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target_i | tokens <= i) at every position, in fp32 ([rows, width])."""
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def forward_backward(model, fb: ForwardBackward, device: str) -> tuple[list[list[float]], float, int]:
    """Per datum, the target tokens' log-probs; the loss; the tokens it weighed. Gradients add to the adapter's."""
    ids, mask = padded(fb.data, device)
    targets = column(fb.data, "target_tokens", ids.shape[1], device, torch.long)
    with torch.set_grad_enabled(not fb.forward_only):
        lp = target_logprobs(model, ids, mask, targets)
        loss, weighed = loss_of(fb, lp, fb.data, mask)
        if not fb.forward_only:
            loss.backward()
    rows = lp.detach().cpu()
    return [rows[i, : len(d.tokens)].tolist() for i, d in enumerate(fb.data)], float(loss.detach()), weighed


def optim_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], step: OptimStep) -> float:
    """One AdamW step with the caller's settings; the gradient's norm before any clipping."""
    for group in optimizer.param_groups:
        group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps)
        group["weight_decay"] = step.weight_decay
    clip = step.grad_clip_norm if step.grad_clip_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)  # one call over the tensors, on CPU too
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def save_state(model, optimizer, step: int, path: Path) -> Path:
    """The adapter (PEFT's layout) and the optimizer's state: enough to go on from, here or on another node."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path / "adapter", safe_serialization=True, selected_adapters=["default"])
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, path / "trainer_state.pt")
    return path


def load_state(load_weights, optimizer, path: Path, with_optimizer: bool) -> int:
    """Load a state save_state wrote (tensors only: never arbitrary pickles) through `load_weights` (the adapter's
    weights under peft's saved names into the session's adapter); the step it was taken at."""
    from safetensors.torch import load_file

    load_weights(load_file(str(path / "adapter" / "adapter_model.safetensors")))
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    if with_optimizer:
        optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


PENDING_GRADS = "pending_grads.safetensors"


def save_pending_grads(model, path: Path) -> None:
    """The adapter's gradients that no optim_step has taken yet (forward_backwards since the last step), by their
    parameters' names, beside a paused session's state; none: no file. A pause (idle, silent client, preemption)
    may come between a forward_backward and its optim_step: without them that step would take nothing."""
    from safetensors.torch import save_file

    grads = {name: p.grad.detach().cpu().contiguous() for name, p in model.named_parameters() if p.grad is not None}
    target = path / PENDING_GRADS
    if grads:
        save_file(grads, str(target))
    else:
        target.unlink(missing_ok=True)


def load_pending_grads(model, path: Path) -> int:
    """The gradients save_pending_grads kept, back on the adapter's parameters; how many."""
    from safetensors.torch import load_file

    source = path / PENDING_GRADS
    if not source.is_file():
        return 0
    grads = load_file(str(source))
    params = dict(model.named_parameters())
    for name, grad in grads.items():
        if name in params:
            params[name].grad = grad.to(params[name].device, params[name].dtype)
    return len(grads)


def sample(model, tokenizer, s: Sample, device: str) -> list[SampledSequence]:
    """num_samples completions of the prompt, each with its tokens' log-probabilities as the forward computes them
    (temperature 1, the adapter's own), and why it stopped."""
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    stops = set(s.stop_tokens) | ({eos} if eos is not None else set())
    if s.seed is not None:
        torch.manual_seed(s.seed)
    config = GenerationConfig(
        max_new_tokens=s.max_tokens,
        do_sample=s.temperature > 0,
        temperature=s.temperature if s.temperature > 0 else None,
        top_k=s.top_k if s.top_k > 0 else None,
        top_p=s.top_p if s.temperature > 0 else None,
        eos_token_id=sorted(stops) or None,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    ids = torch.tensor([s.prompt] * s.num_samples, device=device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    sequences = []
    for row in out[:, len(s.prompt) :].tolist():
        tokens, stop = cut(row, stops, s.stop_strings, tokenizer, s.max_tokens)
        sequences.append(SampledSequence(tokens=tokens, logprobs=scored(model, s.prompt, tokens, device), stop=stop))
    return sequences


def cut(
    row: list[int], stops: set[int], strings: list[str], tokenizer, max_tokens: int
) -> tuple[list[int], Literal["stop", "length"]]:
    """The completion up to and including its first stop token or stop string."""
    for n, token in enumerate(row):
        if token in stops:
            return row[: n + 1], "stop"
        if strings and any(x in tokenizer.decode(row[: n + 1]) for x in strings):
            return row[: n + 1], "stop"
    return row, "length" if len(row) >= max_tokens else "stop"


def scored(model, prompt: list[int], tokens: list[int], device: str) -> list[float | None]:
    """log p of each completion token given what precedes it."""
    if not tokens:
        return []
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    targets = torch.tensor([prompt[1:] + tokens], device=device)
    with torch.no_grad():
        lp = target_logprobs(model, ids, torch.ones_like(ids), targets)
    return lp[0, len(prompt) - 1 :].tolist()
