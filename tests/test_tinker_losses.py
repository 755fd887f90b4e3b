"""Every loss the `tinker` client 0.38 names, against a reference computed here from its formula: first the
trainer's loss_of on made-up log-probabilities (value and gradient), then through the whole stack with the official
client (loss:sum against the formula applied to the log-probabilities the same call returned), stable_reinforce on
sequences sampled with record_stability_info and named by provenance, and the refusals that say what to change."""

from __future__ import annotations

import asyncio
import math
import os

import pytest
import torch

from schemas.sessions import LOSS_CONFIG, RECORDED_LOGPROBS, SAMPLED_MASK, Datum, ForwardBackward
from tests.test_tinker_api import client, gateway, key_for  # noqa: F401  (gateway: the fixture)

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")

Q = [-0.5, -0.7, -0.4, -0.9, -0.6]  # the sampler's log-probs of the targets
ADV = [0.0, 1.0, -1.0, 0.5, 2.0]  # the first position a prompt token: no advantage


def reference(loss: str, lp: list[float], q: list[float], adv: list[float], config: dict, mask: list[float]):
    """The loss of one datum and its gradient by each log-prob, token by token from the formulas (README, Tinker):
    lp the learner's log-probs, q the sampler's, adv the advantages, mask stable_reinforce's sampled tokens."""
    value, grad = 0.0, [0.0] * len(lp)
    c = {**LOSS_CONFIG[loss], **config}
    lo, hi = c.get("clip_low_threshold"), c.get("clip_high_threshold")
    seq = math.exp(sum(lp[t] - q[t] for t in range(len(lp)) if adv[t]) / sum(1 for a in adv if a))  # gspo's ratio
    for t, (x, q, a) in enumerate(zip(lp, q, adv)):
        r = math.exp(x - q)
        if loss == "importance_sampling":
            value, grad[t] = value - r * a, -r * a
        elif loss in ("ppo", "gspo"):
            r = seq if loss == "gspo" else r
            value -= min(r * a, min(max(r, lo), hi) * a)
            grad[t] = -r * a if (a > 0 and r < hi) or (a < 0 and r > lo) else 0.0
        elif loss == "cispo":
            w = min(max(r, lo), hi)
            value, grad[t] = value - w * x * a, -w * a
        elif loss == "dro":
            m = 1.0 if a else 0.0
            value -= x * a - 0.5 * c["beta"] * (x - q) ** 2 * m
            grad[t] = -(a - c["beta"] * (x - q) * m)
        elif loss == "stable_reinforce":
            m, w = mask[t], min(r, hi)
            value += m * (-w * x * a + 0.5 * c["kl_coeff"] * (x - q) ** 2)
            grad[t] = m * (-w * a + c["kl_coeff"] * (x - q))
    return value, grad


CASES = [
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("dro", {"beta": 0.1}),
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}),
    ("stable_reinforce", {}),
    ("stable_reinforce", {"clip_high_threshold": 1.2, "kl_coeff": 0.3}),
]


@pytest.mark.parametrize("loss,config", CASES)
def test_each_loss_is_its_formula_value_and_gradient(loss, config):
    from trainer.session import model as ops

    lp_values = [-0.2, -1.0, -0.45, -0.6, -0.1]
    inputs = {"target_tokens": [2, 3, 4, 5, 6], "logprobs": Q, "advantages": ADV}
    mask = [0.0, 1.0, 1.0, 1.0, 1.0]
    if loss == "stable_reinforce":  # the recorded log-probs the gateway fills; the client's copy is ignored
        inputs |= {"logprobs": [0.0] * 5, RECORDED_LOGPROBS: Q, SAMPLED_MASK: mask}
    data = [Datum(tokens=[1, 2, 3, 4, 5], inputs=inputs)]
    lp = torch.tensor([lp_values], requires_grad=True)
    fb = ForwardBackward(data=data, loss_fn=loss, config=config)
    ops.check_batch(fb, vocab=16)
    value, weighed = ops.loss_of(fb, lp, data, torch.ones(1, 5, dtype=torch.long))
    value.backward()
    expected, grad = reference(loss, lp_values, Q, ADV, config, mask)
    assert weighed == 4
    assert value.item() == pytest.approx(expected, rel=1e-5, abs=1e-6), (loss, config)
    assert lp.grad[0].tolist() == pytest.approx(grad, rel=1e-5, abs=1e-6), (loss, config)


def test_cross_entropy_weighs_the_weighted_tokens():
    from trainer.session import model as ops

    lp = torch.tensor([[-0.2, -1.0, -0.45]], requires_grad=True)
    data = [Datum(tokens=[1, 2, 3], inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 2.0]})]
    value, weighed = ops.loss_of(ForwardBackward(data=data, loss_fn="cross_entropy"), lp, data, torch.ones(1, 3))
    value.backward()
    assert value.item() == pytest.approx(1.0 + 0.9) and weighed == 2
    assert lp.grad[0].tolist() == [0.0, -1.0, -2.0]


# --- through the stack, with the official client ----------------------------------------------------------------


def rl_datums(tokenizer, types, sampler, with_provenance: bool):
    """Two sampled completions of one prompt as the cookbook's rl_loop builds them (its advantages centred), and
    the log-probs the sampler gave back."""
    prompt = types.ModelInput.from_ints(tokenizer.encode("What is the capital of France? "))
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11)
    sequences = sampler.sample(prompt=prompt, num_samples=2, sampling_params=params).result().sequences
    out = []
    for seq, advantage in zip(sequences, (1.0, -1.0)):
        ob = prompt.length - 1
        model_input = prompt.append(types.EncodedTextChunk(tokens=seq.tokens[:-1]))
        datum = types.Datum(
            model_input=model_input,
            loss_fn_inputs={
                "target_tokens": [0] * ob + seq.tokens,
                "logprobs": [0.0] * ob + seq.logprobs,
                "advantages": [0.0] * ob + [advantage] * (model_input.length - ob),
            },
        )
        if with_provenance:
            datum = datum.with_provenance(
                model_input=[
                    types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=prompt.length),
                    types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1),
                ],
                loss_fn_inputs=[
                    types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=prompt.length - 1),
                    types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens)),
                ],
            )
        out.append((datum, ob, seq.logprobs))
    return out


def drive(gw, key: str) -> dict:
    import tinker
    from tinker import types

    out: dict = {"losses": {}, "refused": {}}
    with client(gw, key) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
        tokenizer = tc.get_tokenizer()
        recorded = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        plain = tc.save_weights_and_get_sampling_client().result()
        batch = rl_datums(tokenizer, types, recorded, with_provenance=True)
        for loss, config in CASES:
            data = [d for d, _, _ in batch]
            if loss == "stable_reinforce":  # the client's logprobs garbled: the recorded ones are used
                data = [
                    types.Datum(
                        model_input=d.model_input,
                        loss_fn_inputs={**d.loss_fn_inputs, "logprobs": [0.0] * d.model_input.length},
                        model_input_spans=d.model_input_spans,
                        loss_fn_input_spans=d.loss_fn_input_spans,
                    )
                    for d in data
                ]
            result = tc.forward_backward(data, loss, config).result()
            lps = [o["logprobs"].tolist() for o in result.loss_fn_outputs]
            out["losses"][(loss, tuple(config.items()))] = (result.metrics["loss:sum"], lps)
        out["batch"] = [(d.loss_fn_inputs["advantages"].tolist(), ob, q) for d, ob, q in batch]

        def refusal(call) -> str:
            try:
                call()
            except tinker.BadRequestError as e:
                return str(e)
            except Exception as e:  # a refusal must be a 4xx, never a retried 5xx or a success
                return f"not a 400: {type(e).__name__}: {e}"
            return "accepted"

        data = [d for d, _, _ in batch]
        bare = [types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs) for d in data]
        unrecorded = [d for d, _, _ in rl_datums(tokenizer, types, plain, with_provenance=True)]
        on_prompt = [
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={**d.loss_fn_inputs, "advantages": [1.0] * d.model_input.length},
                model_input_spans=d.model_input_spans,
                loss_fn_input_spans=d.loss_fn_input_spans,
            )
            for d in data
        ]
        out["refused"] = {
            "unknown key": refusal(lambda: tc.forward_backward(data, "ppo", {"beta": 0.1}).result()),
            "no provenance": refusal(lambda: tc.forward_backward(bare, "stable_reinforce").result()),
            "not recorded": refusal(lambda: tc.forward_backward(unrecorded, "stable_reinforce").result()),
            "prompt advantage": refusal(lambda: tc.forward_backward(on_prompt, "stable_reinforce").result()),
            "custom": refusal(lambda: tc.forward_backward(data, "custom", {"loss_id": 1.0}).result()),
        }
        out["after"] = tc.forward(data, "importance_sampling").result().metrics["loss:sum"]  # the turns went on
    return out


async def test_every_loss_through_the_official_client_is_its_formula(nc, gateway):  # noqa: F811
    out = await asyncio.to_thread(drive, gateway, await key_for(nc, "acme"))
    for (loss, config), (total, lps) in out["losses"].items():
        expected = 0.0
        for (advantages, ob, sampled), lp in zip(out["batch"], lps):
            q, mask = [0.0] * ob + sampled, [0.0] * ob + [1.0] * len(sampled)
            expected += reference(loss, lp, q, advantages, dict(config), mask)[0]
        assert total == pytest.approx(expected, rel=1e-4, abs=1e-4), (loss, config, total, expected)
    refused = out["refused"]
    assert "not a setting of ppo" in refused["unknown key"] and "clip_low_threshold" in refused["unknown key"]
    assert "needs each datum's provenance" in refused["no provenance"], refused
    assert "without record_stability_info" in refused["not recorded"], refused
    assert "sampled tokens only" in refused["prompt advantage"], refused
    assert "forward_backward_custom" in refused["custom"], refused
    assert math.isfinite(out["after"])


def test_a_sequence_id_no_sample_gave_out_is_none_never_a_key_or_an_int_that_raises():
    from services.gateway.tinker.provenance import parse_sequence_id, sequence_id

    assert parse_sequence_id(sequence_id("sess-1:train:0:s:ab12", 3, 1796650000)) == ("sess-1:train:0:s:ab12", 3)
    for ident in ("not an id-0-1", "sess-1:s:ab-\u00b2-1", "a.b*-0-1", "x-" + "9" * 5000 + "-1", "-0-1", ""):
        assert parse_sequence_id(ident) is None, ident  # a 400 naming sequence_id, not a 500
