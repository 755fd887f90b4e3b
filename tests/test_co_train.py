"""Many adapters, one base (trainer/co_train): K jobs trained together on one frozen base equal each job trained
alone with plain peft (get_peft_model, the repo's own sft and dpo losses, torch's AdamW, fp32, same seed, data
order and rows per step): per-step losses and final adapter weights within 1e-5, and each saved adapter loads in
peft with the co-trained model's logits within 1e-5. A job whose loss is not a number fails alone; jobs joining
and leaving leave the others as they were."""

from __future__ import annotations

import copy
import functools
import math

import msgspec
import pytest
import torch
from accelerate.utils import set_seed
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import get_scheduler

from schemas.jobs import DatasetRef
from schemas.training import LoraConfig
from tests.conftest import spec_for
from tests.qa import QA_PAIRS
from tests.test_dataset_formats import data_file
from tests.test_dpo import preference_rows
from trainer.data import examples as data
from trainer.co_train.group import CoTrainer
from trainer.multi_lora.layer import MultiLoraLinear, Routing, RoutingHolder
from trainer.multi_lora.peft_export import peft_state_dict, save_peft_adapter
from trainer.objectives.dpo import dpo_loss
from trainer.objectives.losses import batch_loss
from trainer.model import load
from trainer.job.setup import plan
from trainer.data.tokenize import job_data

STEPS = 3
ATTN, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
JOBS = [  # (lora, train): ranks, alphas, targets, lrs, methods, batches, packing, accumulation and seeds all differ
    (dict(r=4, alpha=8, target_modules=ATTN), dict(learning_rate=0.01, batch_size=2)),
    (dict(r=8, alpha=16, target_modules=["q_proj", "v_proj"]), dict(method="dpo", learning_rate=0.02, batch_size=2)),
    (dict(r=2, alpha=32, target_modules=MLP), dict(learning_rate=0.005, packing=False, batch_size=3, seed=7)),
    (dict(r=16, alpha=16, target_modules=ATTN + MLP, rslora=True), dict(learning_rate=0.003, grad_accum=2)),
    (dict(r=1, alpha=4, target_modules=["down_proj"], init="gaussian"), dict(learning_rate=0.05, seed=3)),
    (dict(r=8, alpha=8, target_modules=["k_proj", "up_proj"]), dict(learning_rate=0.01, lr_scheduler="constant")),
    (dict(r=4, alpha=16, target_modules=["o_proj"]), dict(method="dpo", learning_rate=0.01, batch_size=1, seed=5)),
    (dict(r=32, alpha=64, target_modules=["q_proj"]), dict(learning_rate=0.002, max_grad_norm=0.0, batch_size=4)),
]


@pytest.fixture(scope="module")
def base(tiny_model):
    tokenizer, model = load(str(tiny_model), "cpu", torch.float32)
    return tokenizer, model


def job_spec(tiny_model, tmp, name: str, lora: dict, train: dict):
    """The job's TrainerSpec, as the agent writes it: Q/A pairs for sft, a preference file for dpo."""
    train = {"max_steps": STEPS, "precision": "fp32", "warmup_steps": 1, "lr_scheduler": "linear", **train}
    spec = spec_for(tiny_model, tmp / name, **train)
    if train.get("method") == "dpo":
        rows = preference_rows(QA_PAIRS[:8], lambda n: QA_PAIRS[n + 8][1])
        prefs = data_file(tmp / f"{name}.jsonl", "preference", rows)
        request = msgspec.structs.replace(spec.request, data=[], dataset=DatasetRef(name=name, sha256=prefs.sha256))
        spec = msgspec.structs.replace(spec, request=request, dataset=prefs, token_cache=str(tmp / name / "tokens"))
    request = msgspec.structs.replace(spec.request, lora=msgspec.convert(lora, LoraConfig))
    return msgspec.structs.replace(spec, job=name, request=request)


def peft_alone(base_model, tokenizer, spec):
    """The job trained alone with plain peft: its per-step losses, final adapter weights (None if its loss stopped
    being a number) and model."""
    t, lo = spec.request.train, spec.request.lora
    set_seed(t.seed)
    init = True if lo.init == "default" else lo.init
    config = PeftLoraConfig(
        r=lo.r, lora_alpha=lo.alpha, target_modules=list(lo.target_modules), use_rslora=lo.rslora,
        init_lora_weights=init, task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(copy.deepcopy(base_model), config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=t.learning_rate, betas=tuple(t.adam_betas), eps=t.adam_eps, weight_decay=t.weight_decay
    )
    train_set, _ = job_data(spec, tokenizer)
    steps = plan(len(data.make_batches(train_set, t, tokenizer.pad_token_id, 0)), t)
    sched = get_scheduler(t.lr_scheduler, opt, num_warmup_steps=steps.warmup, num_training_steps=steps.steps)
    dpo = t.method == "dpo"
    losses, epoch = [], 0
    while len(losses) < steps.steps:
        batches = data.make_batches(train_set, t, tokenizer.pad_token_id, epoch)
        for first in range(0, len(batches), t.grad_accum):
            micro = batches[first : first + t.grad_accum]
            n = sum(b.input_ids.shape[0] // 2 if dpo else int((b.targets != data.IGNORE).sum()) for b in micro)
            step_loss = 0.0
            for b in micro:
                summed = (
                    dpo_loss(model, b, t.dpo_beta, torch.float32, 1024)[0]
                    if dpo
                    else batch_loss(model, b, torch.float32)[0]
                )
                loss = summed / n
                loss.backward()
                step_loss += float(loss.detach())
            losses.append(step_loss)
            if not math.isfinite(step_loss):
                return losses, None, model
            torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or float("inf"))
            opt.step(), sched.step(), opt.zero_grad()
            if len(losses) == steps.steps:
                break
        epoch += 1
    return losses, get_peft_model_state_dict(model), model


@functools.cache
def alone_result(index: int, base_model, tokenizer, tiny_model, tmp):
    spec = job_spec(tiny_model, tmp, f"job{index}", *JOBS[index])
    losses, weights, _ = peft_alone(base_model, tokenizer, spec)
    return losses, weights


def assert_matches_alone(job, alone) -> None:
    losses, weights = alone
    assert [r.loss for r in job.history] == pytest.approx(losses[: len(job.history)], abs=1e-5, rel=0)
    if weights is not None and job.state == "trained":
        mine = peft_state_dict(job.weights)
        assert mine.keys() == weights.keys()
        for key, value in weights.items():
            torch.testing.assert_close(mine[key], value, atol=1e-5, rtol=0)


def co_trained_logits(group: CoTrainer, jobs: list[str], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same input rows for each job, stacked in one batch routed to the jobs' adapters: each job's logits."""
    stacked = ids.repeat(len(jobs), 1)
    routing = Routing.of_rows([j for j in jobs for _ in range(ids.shape[0])])
    group.base.model.eval()
    with torch.no_grad(), group.base.routed(routing):
        logits = group.base.model(input_ids=stacked).logits
    group.base.model.train()
    return {j: logits[k * ids.shape[0] : (k + 1) * ids.shape[0]] for k, j in enumerate(jobs)}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_k_jobs_together_equal_each_alone_in_peft(k, base, tiny_model, tmp_path_factory, tmp_path):
    tokenizer, model = base
    shared_tmp = tmp_path_factory.getbasetemp() / "co_train_alone"
    shared_tmp.mkdir(exist_ok=True)
    group = CoTrainer(copy.deepcopy(model), tokenizer)
    specs = [job_spec(tiny_model, tmp_path, f"job{i}", *JOBS[i]) for i in range(k)]
    for spec in specs:
        group.add_job(spec)
    group.run()
    ids = torch.tensor([tokenizer("What is the capital of France? Paris.")["input_ids"]] * 2)
    ours = co_trained_logits(group, [s.job for s in specs], ids)
    for i, spec in enumerate(specs):
        job = group.jobs[spec.job]
        assert job.state == "trained", job.message
        assert_matches_alone(job, alone_result(i, model, tokenizer, tiny_model, shared_tmp))
        out = save_peft_adapter(job.weights, spec.request.lora, str(tiny_model), tmp_path / "adapters" / spec.job)
        loaded = PeftModel.from_pretrained(copy.deepcopy(model), str(out)).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, ours[spec.job], atol=1e-5, rtol=0)


def test_summed_loss_gives_each_job_its_own_gradient(base, tiny_model, tmp_path):
    """One backward over the jobs' summed losses leaves on each job's parameters its own loss's gradient."""
    tokenizer, model = base
    specs = [job_spec(tiny_model, tmp_path, f"job{i}", *JOBS[i]) for i in range(3)]
    group = CoTrainer(copy.deepcopy(model), tokenizer)
    for spec in specs:
        group.add_job(spec)
    group.forward_backward()
    for spec in specs:
        alone = CoTrainer(copy.deepcopy(model), tokenizer)
        alone.add_job(spec)
        alone.forward_backward()
        pairs = list(zip(group.jobs[spec.job].params, alone.jobs[spec.job].params, strict=True))
        assert any(own.grad.abs().sum() > 0 for _, own in pairs)  # B starts at zero, so A's first gradient is zero
        for together, own in pairs:
            torch.testing.assert_close(together.grad, own.grad, atol=1e-6, rtol=0)


def test_a_job_whose_loss_is_not_a_number_fails_alone(base, tiny_model, tmp_path, tmp_path_factory):
    """A learning rate far past what a request may ask (set past the checks) blows the job's weights up: its loss
    stops being a number at the step it would alone, it fails, and its neighbours train on as they would alone."""
    tokenizer, model = base
    bad_spec = job_spec(tiny_model, tmp_path, "bad", dict(r=4, alpha=8, target_modules=ATTN + MLP), {})
    train = msgspec.structs.replace(bad_spec.request.train, learning_rate=1e30, max_grad_norm=0.0)
    bad_spec = msgspec.structs.replace(bad_spec, request=msgspec.structs.replace(bad_spec.request, train=train))
    group = CoTrainer(copy.deepcopy(model), tokenizer)
    for i in (0, 1):
        group.add_job(job_spec(tiny_model, tmp_path, f"job{i}", *JOBS[i]))
    bad = group.add_job(bad_spec)
    group.run()
    assert bad.state == "failed" and "the loss became nan" in bad.message, bad.message
    own_losses, _, _ = peft_alone(model, tokenizer, bad_spec)
    assert not math.isfinite(own_losses[-1]) and len(own_losses) == bad.at.step + 1  # alone it fails at that step
    assert all("bad" not in layer.adapters for layer in group.base.wrapped.values())  # its LoRA is off the base
    shared_tmp = tmp_path_factory.getbasetemp() / "co_train_alone"
    shared_tmp.mkdir(exist_ok=True)
    for i in (0, 1):
        assert group.jobs[f"job{i}"].state == "trained"
        assert_matches_alone(group.jobs[f"job{i}"], alone_result(i, model, tokenizer, tiny_model, shared_tmp))


def test_jobs_join_and_leave_between_steps_without_changing_the_others(base, tiny_model, tmp_path, tmp_path_factory):
    tokenizer, model = base
    shared_tmp = tmp_path_factory.getbasetemp() / "co_train_alone"
    shared_tmp.mkdir(exist_ok=True)
    group = CoTrainer(copy.deepcopy(model), tokenizer)
    for i in (0, 1, 2):
        group.add_job(job_spec(tiny_model, tmp_path, f"job{i}", *JOBS[i]))
    for _ in range(2):
        group.step()
    left = group.remove_job("job2")  # leaves after its step 2
    group.add_job(job_spec(tiny_model, tmp_path, "job3", *JOBS[3]))  # joins at step 3 (its own step 1)
    group.run()
    assert left.at.step == 2 and "job2" not in group.jobs
    assert_matches_alone(left, alone_result(2, model, tokenizer, tiny_model, shared_tmp))
    for i in (0, 1, 3):
        assert group.jobs[f"job{i}"].state == "trained"
        assert_matches_alone(group.jobs[f"job{i}"], alone_result(i, model, tokenizer, tiny_model, shared_tmp))


def test_rows_of_any_order_get_their_own_adapters_delta():
    """Interleaved rows (an index, not a span) and rows of no adapter: each row gets exactly its adapter's delta."""
    torch.manual_seed(0)
    routing = RoutingHolder()
    layer = MultiLoraLinear(torch.nn.Linear(6, 5), routing)
    from trainer.multi_lora.layer import LoraWeights

    for name, r in (("a", 2), ("b", 3)):
        layer.adapters[name] = LoraWeights(torch.randn(r, 6), torch.randn(5, r), 0.5)
    x = torch.randn(5, 4, 6)
    rows = ["a", "b", None, "a", "b"]
    routing.now = Routing.of_rows(rows)
    assert not isinstance(routing.now.groups[0][1], slice)
    out = layer(x)
    for i, name in enumerate(rows):
        expected = layer.base_layer(x[i])
        if name:
            w = layer.adapters[name]
            expected = expected + x[i] @ w.A.T @ w.B.T * 0.5
        torch.testing.assert_close(out[i], expected)


@pytest.mark.parametrize("tokens", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
@pytest.mark.parametrize("wide", [False, True])
def test_spans_of_alike_adapters_batched_get_each_its_own_delta_and_gradient(tokens, dropout, wide):
    """Spans laid end to end (trainer/multi_lora/layer.py's runs: adjacent spans of one size and rank go through one
    batched matmul; other ranks, sizes, a dropout and gaps of no adapter beside them), as token positions of one row
    (the group's flat layout) or as rows (a session group's batch); without dropout the base and the adapters go as
    one autograd step (trainer/multi_lora/fused.py): each row gets its own adapter's delta, and each adapter's
    gradient (and the input's) is what its rows alone give. Ranks below fused.NARROW and (wide) from it: the
    backward computes the r-wide products transposed below it."""
    from trainer.multi_lora import fused
    from trainer.multi_lora.layer import LoraWeights

    torch.manual_seed(0)
    routing = RoutingHolder()
    layer = MultiLoraLinear(torch.nn.Linear(6, 5).requires_grad_(False), routing)  # frozen, as a group's base
    spans = [("a", 0, 4, 2), ("b", 4, 8, 2), ("c", 8, 12, 2), ("d", 12, 16, 3), ("e", 18, 21, 2), ("f", 21, 25, 2)]
    for name, _, _, r in spans:
        r += fused.NARROW if wide else 0
        A, B = torch.randn(r, 6, requires_grad=True), torch.randn(5, r, requires_grad=True)
        layer.adapters[name] = LoraWeights(A, B, {"c": 0.25}.get(name, 0.5), dropout if name == "f" else 0.0)
    layer.adapters["f"].generator = torch.Generator().manual_seed(1)
    routing.now = Routing([(name, slice(start, stop)) for name, start, stop, _ in spans], tokens=tokens)
    x = (torch.randn(1, 27, 6) if tokens else torch.randn(27, 3, 6)).requires_grad_()
    mine = (lambda t, a, b: t[0, a:b]) if tokens else (lambda t, a, b: t[a:b])  # noqa: E731
    layer.train()
    assert fused.takes(layer.base_layer, x, list(layer.adapters.values()), True) == (not dropout)  # the path tested
    out = layer(x)
    out.square().sum().backward()
    grad_x, x.grad = x.grad.clone(), None
    layer.adapters["f"].generator.manual_seed(1)
    for name, start, stop, _ in spans:
        w = layer.adapters[name]
        got = [w.A.grad.clone(), w.B.grad.clone()]
        w.A.grad = w.B.grad = None
        alone = layer.base_layer(mine(x, start, stop)) + w.delta(mine(x, start, stop), training=True)
        torch.testing.assert_close(mine(out, start, stop), alone)
        alone.square().sum().backward()
        torch.testing.assert_close(got, [w.A.grad, w.B.grad])
        torch.testing.assert_close(mine(grad_x, start, stop), mine(x.grad, start, stop))
    for gap in ((16, 18), (25, 27)):
        torch.testing.assert_close(mine(out, *gap), layer.base_layer(mine(x, *gap)))


def test_a_job_evaluates_its_own_adapter_as_peft_would(base, tiny_model, tmp_path):
    """Between steps a job's held-out loss is its adapter's alone, whoever shares the base: equal to the saved
    adapter's loaded in peft, through the same evaluate()."""
    from trainer.job.loop import evaluate

    tokenizer, model = base
    group = CoTrainer(copy.deepcopy(model), tokenizer)
    specs = [
        job_spec(tiny_model, tmp_path, f"job{i}", JOBS[i][0], {**JOBS[i][1], "eval_fraction": 0.25}) for i in (0, 1)
    ]
    for spec in specs:
        group.add_job(spec)
    group.run()
    for spec in specs:
        job = group.jobs[spec.job]
        out = save_peft_adapter(job.weights, spec.request.lora, str(tiny_model), tmp_path / "adapters" / spec.job)
        loaded = PeftModel.from_pretrained(copy.deepcopy(model), str(out))
        batches = data.make_batches(job.eval_set, job.train, tokenizer.pad_token_id, 0)
        own = evaluate(loaded, batches, "cpu", torch.float32, 1024, objective=job.objective)
        assert job.evaluate("cpu") == pytest.approx(own, abs=1e-5, rel=0)


def test_a_step_out_of_memory_is_undone_and_the_others_train_on_as_alone(
    base, tiny_model, tmp_path, tmp_path_factory, monkeypatch
):
    """A shared step that runs out of memory (injected past a token budget: a CPU has no device memory to run out of)
    is undone for every job, one mid-way through its accumulation included; the largest job is named to leave, and
    once it has the others go on exactly as they would alone."""
    from trainer.co_train.group import OOM_FAULT_ENV, StepOutOfMemory

    tokenizer, model = base
    monkeypatch.setenv(OOM_FAULT_ENV, "1000")  # the two jobs' steps hold at most 2 x 128 + 128 positions
    group = CoTrainer(copy.deepcopy(model), tokenizer)
    for i in (0, 3):  # job3 accumulates two micro-batches a step
        group.add_job(job_spec(tiny_model, tmp_path, f"job{i}", *JOBS[i]))
    group.step()  # job0 stepped, job3 half-way through its first step
    huge = job_spec(tiny_model, tmp_path, "huge", dict(r=4, alpha=8, target_modules=ATTN), dict(batch_size=64))
    huge = msgspec.structs.replace(huge, request=msgspec.structs.replace(huge.request, data=data_rows(6)))
    group.add_job(huge)
    with pytest.raises(StepOutOfMemory) as failed:
        group.step()
    assert failed.value.largest == "huge" and failed.value.positions["huge"] > 1000, failed.value.positions
    assert all(p.grad is None for p in group.jobs["job3"].params)  # its half-step undone
    group.remove_job("huge")
    group.run()
    shared_tmp = tmp_path_factory.getbasetemp() / "co_train_alone"
    shared_tmp.mkdir(exist_ok=True)
    for i in (0, 3):
        assert group.jobs[f"job{i}"].state == "trained"
        assert_matches_alone(group.jobs[f"job{i}"], alone_result(i, model, tokenizer, tiny_model, shared_tmp))


def data_rows(times: int) -> list:
    """The Q/A pairs `times` over (a job with many rows)."""
    from schemas.jobs import QA

    return [QA(q=q, a=a) for _ in range(times) for q, a in QA_PAIRS]
