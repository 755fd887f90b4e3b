"""The chunked loss is the plain loss: the same value and the same gradients (fp32, 1e-5), a chunk at a time."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import spec_for
from trainer import model as base
from trainer.data import examples as data
from trainer.objectives.chunked_loss import IGNORE, chunked_cross_entropy
from trainer.objectives.losses import batch_loss, output_head
from trainer.job.setup import lora_model


def plain(hidden, weight, targets, scale=1.0):
    logits = (hidden @ weight.T).float() / scale
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("chunk, scale", [(7, 1.0), (64, 1.0), (1000, 1.0), (16, 8.0)])
def test_value_and_gradients_match_the_plain_loss(chunk, scale):
    torch.manual_seed(0)
    hidden = torch.randn(150, 32, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(500, 32).requires_grad_()
    targets = torch.randint(0, 500, (150,))
    targets[::5] = IGNORE  # ignored tokens count for nothing
    expected = plain(hidden, weight, targets, scale)
    expected.backward()
    want_h, want_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None

    got = chunked_cross_entropy(hidden, weight, targets, chunk, scale)
    (got * 1.0).backward()
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (float(got), float(expected))
    assert torch.allclose(hidden.grad, want_h, rtol=1e-5, atol=1e-5)
    assert torch.allclose(weight.grad, want_w, rtol=1e-5, atol=1e-5)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_do():
    hidden = torch.randn(20, 8, requires_grad=True)
    weight = torch.randn(30, 8)  # frozen, as the base model's lm_head is under LoRA
    loss = chunked_cross_entropy(hidden, weight, torch.randint(0, 30, (20,)), 6)
    loss.backward()
    assert hidden.grad is not None and weight.grad is None


def test_the_trainer_loss_and_lora_gradients_are_the_same_chunked_or_not(tiny_model, tmp_path):
    spec = spec_for(tiny_model, tmp_path)
    tokenizer, model = base.load(str(tiny_model), "cpu", torch.float32)
    model = lora_model(model, spec)
    assert output_head(model) is not None  # a Llama head: the chunked path is taken
    examples = data.encode(tokenizer, spec.request.data, 128, True)
    batch = data.make_batches(examples, spec.request.train, tokenizer.eos_token_id, epoch=0)[0]
    grads = []
    for chunk in (0, 5):  # 0: the plain loss
        model.zero_grad()
        loss, n = batch_loss(model, batch, torch.float32, chunk)
        loss.backward()
        grads.append((float(loss), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}))
    (plain_loss, n0, plain_grads), (chunked_loss, n1, chunked_grads) = grads
    assert n0 == n1 > 0 and abs(plain_loss - chunked_loss) <= 1e-5 * abs(plain_loss)
    worst = max(
        float((chunked_grads[k] - g).abs().max() / g.abs().max().clamp_min(1e-12))
        for k, g in plain_grads.items()
        if g.abs().max() > 0
    )
    print(f"largest gradient difference, relative to the tensor's largest gradient: {worst:.1e}")
    assert worst < 1e-5
