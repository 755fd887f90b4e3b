"""GRPO's loss: jetlora's and TRL's GRPOTrainer's (its default loss, "dapo") agree on the same completions, rewards
and adapter, in value and in every LoRA weight's gradient, without the KL term and with it. TRL's own loss
computation is driven on our batch (its generation would sample other completions): the prompt and completion ids,
masks and advantages it would have made of them, its reference log-probs from its own code."""

from __future__ import annotations

import pytest
import torch

from schemas.training import LoraConfig
from trainer.adapter_init import lora_config
from trainer.objectives.grpo import grpo_loss
from trainer.model import load
from trainer.objectives.rollouts import Rollout, group_advantages

TEMPERATURE, EPSILON, GROUP = 0.7, 0.2, 3
QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?"]
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0]


def adapted(model_dir: str, start: dict | None = None):
    """The tiny model with a LoRA whose B is not zero (so the adapter differs from the base: a KL to measure)."""
    from peft import get_peft_model

    tok, base = load(model_dir, "cpu", torch.float32)
    model = get_peft_model(base, lora_config(LoraConfig(r=4, alpha=8), "cpu"))
    if start is None:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
        start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.load_state_dict(start, strict=False)
    model.train()
    return tok, model, start


ENDS = [3, None, 7, 0, None, 11]  # where each completion's eos is (None: it runs to the limit, 12 tokens)


def our_batch(tok, model) -> Rollout:
    """Fixed completions, GROUP per prompt (some ending early), in TRL's layout: prompts left-padded, completions
    right-padded, each counted through its first eos; the advantages of fixed rewards."""
    chat = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chat]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len(prompts[0]) != len(prompts[1])  # one of them is left-padded
    width, rows = max(map(len, prompts)), len(ENDS)
    ids = torch.full((rows, width + 12), tok.pad_token_id)
    attention = torch.zeros((rows, width + 12), dtype=torch.long)
    completion_mask = torch.zeros((rows, 12), dtype=torch.long)
    words = torch.randint(10, len(tok), (rows, 12), generator=torch.Generator().manual_seed(1))
    for n, end in enumerate(ENDS):
        prompt, length = prompts[n // GROUP], 12 if end is None else end + 1
        ids[n, width - len(prompt) : width] = torch.tensor(prompt)
        ids[n, width : width + length] = words[n, :length]
        if end is not None:
            ids[n, width + end] = tok.eos_token_id
        attention[n, width - len(prompt) : width + length] = 1
        completion_mask[n, :length] = 1
    advantages = group_advantages(torch.tensor(REWARDS), GROUP)
    return Rollout(ids, attention, completion_mask, advantages, [""] * rows, [], 0.0)


def trl_loss(tmp_path, tok, model, batch: Rollout, beta: float) -> torch.Tensor:
    """TRL's GRPOTrainer's loss on our batch, as its training step computes it (train mode, one process)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(REWARDS),
        num_generations=GROUP,
        beta=beta,
        epsilon=EPSILON,
        temperature=TEMPERATURE,
        max_completion_length=12,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    assert args.loss_type == "dapo" and args.num_iterations == 1 and args.scale_rewards == "group"  # defaults
    prompt = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list(prompt),
        processing_class=tok,
    )
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets
    width = batch.completion_mask.shape[1]
    inputs = {
        "prompt_ids": batch.input_ids[:, :-width],
        "prompt_mask": batch.attention_mask[:, :-width],
        "completion_ids": batch.input_ids[:, -width:],
        "completion_mask": batch.completion_mask,
        "advantages": batch.advantages,
        "num_items_in_batch": batch.completion_mask.sum(),
    }
    if beta:
        with torch.no_grad(), trainer.model.disable_adapter():  # TRL's reference for a new adapter
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                trainer.model, batch.input_ids, batch.attention_mask, width
            )[0]
    trainer.model.train()
    return trainer._compute_loss(trainer.model, inputs)


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_grpo_loss_and_its_gradients_are_trls(tiny_model, tmp_path, beta):
    pytest.importorskip("trl")
    tok, ours, start = adapted(str(tiny_model))
    batch = our_batch(tok, ours)
    total, kl = grpo_loss(ours, batch, beta, EPSILON, TEMPERATURE, torch.float32, 1024)
    loss = total / batch.completion_mask.sum()
    loss.backward()
    assert (kl > 0) == bool(beta)

    _, theirs, _ = adapted(str(tiny_model), start)
    their_loss = trl_loss(tmp_path, tok, theirs, batch, beta)
    their_loss.backward()

    assert abs(float(loss) - float(their_loss)) < 1e-5, (float(loss), float(their_loss))
    mine, trls = lora_grads(ours), lora_grads(theirs)
    assert mine.keys() == trls.keys() and len(mine) > 0
    scale = max(float(g.abs().max()) for g in trls.values())
    assert scale > 0
    for name in mine:
        assert torch.allclose(mine[name], trls[name], atol=1e-5 * max(scale, 1.0), rtol=0), name


def test_the_log_probs_are_the_same_through_the_projection_in_chunks_or_whole(tiny_model):
    """The output projection a chunk of tokens at a time (checkpointed) or all at once: the same loss and grads."""
    tok, model, _ = adapted(str(tiny_model))
    batch = our_batch(tok, model)
    results = []
    for chunk in (0, 5):
        model.zero_grad()
        total, _ = grpo_loss(model, batch, 0.04, EPSILON, TEMPERATURE, torch.float32, chunk)
        total.backward()
        results.append((float(total), lora_grads(model)))
    (a, grads_a), (b, grads_b) = results
    assert abs(a - b) < 1e-5 * max(abs(a), 1.0)
    worst = max(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a)
    scale = max(float(g.abs().max()) for g in grads_a.values())
    assert worst < 1e-4 * scale, (worst, scale)  # fp32 sums in another order: a few ulps of the largest
