"""Preference tuning (DPO): the trainer's per-step losses and reward margins agree with TRL's DPOTrainer (with
peft) on the same tiny model, pairs, token ids, start and hyperparameters; trained, the adapter prefers the chosen
answers of pairs it never saw; preference rows are checked at upload."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from schemas.dataset_check import DatasetInvalid, check_file
from schemas.events import Progress
from schemas.jobs import DatasetRef
from tests.conftest import spec_for
from tests.qa import QA_PAIRS
from tests.test_dataset_formats import data_file
from tests.test_trainer import events_from
from trainer.job import loop
from trainer.objectives.dpo import PairStats, dpo_loss
from trainer.job.setup import prepare

REFUSAL = "I do not know."


def preference_rows(pairs=QA_PAIRS, rejected=lambda n: REFUSAL) -> list[dict]:
    return [
        {
            "input": {
                "messages": [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": q}]
            },
            "preferred_output": [{"role": "assistant", "content": a}],
            "non_preferred_output": [{"role": "assistant", "content": rejected(n)}],
        }
        for n, (q, a) in enumerate(pairs)
    ]


def dpo_spec(tiny_model, tmp_path, rows, **train):
    t = {"method": "dpo", "dpo_beta": 0.1, "precision": "fp32", "lr_scheduler": "linear", "warmup_ratio": 0.0, **train}
    spec = spec_for(tiny_model, tmp_path, **t)
    data = data_file(tmp_path / "prefs.jsonl", "preference", rows)
    request = msgspec.structs.replace(spec.request, data=[], dataset=DatasetRef(name="prefs", sha256=data.sha256))
    return msgspec.structs.replace(spec, request=request, dataset=data, token_cache=str(tmp_path / "tokens"))


def trl_rows(examples) -> list[dict]:
    """Our token ids as TRL's tokenized columns: the prompt, then each answer through its last learnt token."""
    out = []
    for i in range(len(examples) // 2):
        sides = []
        for ids, targets in (examples[2 * i], examples[2 * i + 1]):
            learnt = (targets != -100).nonzero()[0]
            first, last = int(learnt[0]) + 1, int(learnt[-1]) + 1  # targets[t] is the token after ids[t]
            sides.append((ids[:first].tolist(), ids[first : last + 1].tolist()))
        (prompt, chosen), (prompt_r, rejected) = sides
        assert prompt == prompt_r, "both answers follow the same prompt tokens"
        out.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    return out


def test_dpo_matches_trls_dpo_trainer_step_by_step(tiny_model, tmp_path, monkeypatch, capsys):
    pytest.importorskip("trl")
    from datasets import Dataset
    from peft import get_peft_model
    from trl import DPOConfig, DPOTrainer

    from trainer.adapter_init import lora_config
    from trainer.model import load

    pairs = 8
    spec = dpo_spec(
        tiny_model,
        tmp_path,
        preference_rows(QA_PAIRS[:pairs], lambda n: QA_PAIRS[n + 8][1]),
        batch_size=pairs,
        epochs=10,
        max_steps=0,
        learning_rate=0.005,
        max_seq_length=128,
    )
    run = prepare(spec)
    start = {name: p.detach().clone() for name, p in run.model.named_parameters() if p.requires_grad}
    rows = trl_rows(run.train_set)
    monkeypatch.setattr(loop, "prepare", lambda _: run)  # the loop trains the run whose start was kept
    finished = loop.train(spec)
    ours = [e for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)]
    assert finished.step == 10 and len(ours) == 10 and ours[0].preference is not None

    class OurTokens(DPOTrainer):  # TRL trains on our token ids: this compares the loss and its optimisation
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset

    tok, base = load(str(tiny_model), "cpu", torch.float32)
    model = get_peft_model(base, lora_config(spec.request.lora, "cpu"))
    model.load_state_dict(start, strict=False)
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters() if p.requires_grad)
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=pairs,
        max_steps=10,
        learning_rate=0.005,
        lr_scheduler_type="linear",
        warmup_steps=0,
        beta=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        optim="adamw_torch",
        use_cpu=True,
        max_length=None,
        save_strategy="no",
        seed=42,
        weight_decay=0.0,
        bf16=False,
    )  # TRL's default is bf16: fp32 here
    trainer = OurTokens(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == 10
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert abs(a.loss - b["loss"]) < 1e-4, (step, a.loss, b["loss"])
        assert abs(a.preference.margin - b["rewards/margins"]) < 1e-4, (step, a.preference, b)
        assert abs(a.preference.accuracy - b["rewards/accuracies"]) < 1e-6
    assert ours[-1].loss < ours[0].loss  # and it learnt


def held_out_preference(run) -> PairStats:
    """The rewards of the run's held-out pairs, under the adapter as it is now."""
    stats = PairStats()
    run.model.eval()
    with torch.no_grad():
        for batch in filter(None, run.eval_batches):
            stats.add(dpo_loss(run.model, batch, 0.1, torch.float32, 1024)[1])
    run.model.train()
    return stats


def test_trained_with_dpo_the_adapter_prefers_the_chosen_answers_of_unseen_pairs(
    tiny_model, tmp_path, monkeypatch, capsys
):
    spec = dpo_spec(
        tiny_model,
        tmp_path,
        preference_rows(),
        batch_size=4,
        epochs=6,
        max_steps=0,
        learning_rate=0.01,
        eval_fraction=0.25,
        max_seq_length=128,
    )
    run = prepare(spec)
    before = held_out_preference(run)
    monkeypatch.setattr(loop, "prepare", lambda _: run)
    finished = loop.train(spec)
    after = held_out_preference(run)
    assert finished.state == "trained" and after.pairs == before.pairs == 4  # a quarter of 16 pairs held out
    assert before.chosen == before.rejected == 0 and before.correct == 0  # the adapter starts as the reference
    assert (after.chosen - after.rejected) / after.pairs > 0.1 and after.correct == after.pairs, after
    progress = [e for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)]
    assert progress[-1].eval_loss is not None and progress[-1].eval_loss < 0.693  # below log 2: better than chance
    assert progress[-1].preference.accuracy == 1.0 and progress[-1].preference.margin > 0


def test_preference_rows_are_checked_at_upload(tmp_path):
    good = preference_rows(QA_PAIRS[:3])
    assert check_file(data_file(tmp_path / "ok.jsonl", "preference", good).path).format == "preference"
    for broken, said in (
        (dict(good[0], preferred_output=[]), "preferred_output must be one assistant message"),
        (dict(good[0], non_preferred_output=good[0]["preferred_output"]), "the same answer"),
        (dict(good[0], input={"messages": []}), "input.messages must hold the conversation"),
    ):
        path = data_file(tmp_path / "bad.jsonl", "preference", [good[1], broken]).path
        with pytest.raises(DatasetInvalid, match=said) as e:
            check_file(path)
        assert "line 2" in str(e.value)


def test_a_dpo_job_names_a_preference_dataset_and_runs_on_one_device():
    from schemas.job_checks import parse_job_request
    from schemas.validate import InvalidRequest

    base = {"model": "tiny", "base_dir": "/m", "train": {"method": "dpo"}}
    for extra, field in (
        ({"data": [{"q": "a", "a": "b"}]}, "data"),
        ({"dataset": {"name": "p"}, "devices": 2, "accelerator": "gpu"}, "devices"),
        ({"dataset": {"name": "p"}, "train": {"method": "dpo", "grad_accum": 2}}, "train.grad_accum"),
    ):
        with pytest.raises(InvalidRequest) as e:
            parse_job_request(msgspec.json.encode({**base, **extra}))
        assert field in [err.field for err in e.value.errors], e.value.errors
    assert parse_job_request(msgspec.json.encode({**base, "dataset": {"name": "p"}})).train.dpo_beta == 0.1


def test_dpo_after_sft_starts_from_the_adapter_and_holds_it_as_the_reference(tiny_model, tmp_path, capsys):
    import math

    from safetensors.torch import load_file

    sft = loop.train(spec_for(tiny_model, tmp_path / "sft", max_steps=20))
    capsys.readouterr()
    spec = dpo_spec(
        tiny_model, tmp_path, preference_rows(), batch_size=4, max_steps=3, learning_rate=0.01, max_seq_length=128
    )
    spec = msgspec.structs.replace(spec, init_adapter=sft.adapter_dir)
    run = prepare(spec)
    trained = load_file(f"{sft.adapter_dir}/adapter_model.safetensors")
    start = {n.replace(".default", ""): p for n, p in run.model.named_parameters() if p.requires_grad}
    assert len(start) == len(trained) and all(torch.equal(start[n], trained[n]) for n in trained)  # the sft adapter

    finished = loop.train(spec)
    progress = [e for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)]
    # the reference is the sft adapter as it started (not the base): the first step's policy equals it exactly
    assert abs(progress[0].loss - math.log(2)) < 1e-6 and progress[0].preference.margin == 0
    assert progress[-1].loss < progress[0].loss
    saved = Path(finished.adapter_dir)
    assert (saved / "adapter_model.safetensors").exists() and not (saved / "ref").exists()


async def test_a_job_starting_from_an_adapter_is_pinned_to_its_version_or_refused_naming_the_field(stack, nc, tmp_path):
    from schemas import names
    from schemas.datasets import DatasetUpload
    from schemas.jobs import Accepted, Rejected
    from schemas.job_status import StoredRequest
    from services.transfer.sender import upload_dataset
    from tests.conftest import submit
    from tests.test_dashboard import promoted_with_a_node_status  # capitals@1 on base model tiny, peft j1/peft

    await promoted_with_a_node_status(nc)
    data = data_file(tmp_path / "p.jsonl", "preference", preference_rows())
    await upload_dataset(nc, "prefs", data.path, DatasetUpload(share=["globex"]))
    base = {"model": "tiny", "base_dir": "/models/tiny", "dataset": {"name": "prefs"}, "train": {"method": "dpo"}}
    for init, field in (
        ({"name": "nope"}, "init_adapter.name"),
        ({"name": "capitals", "version": 7}, "init_adapter.version"),
    ):
        refused = await submit(nc, {**base, "init_adapter": init})
        assert isinstance(refused, Rejected) and refused.errors[0].field == field, refused
    other_base = await submit(nc, {**base, "model": "other", "init_adapter": {"name": "capitals"}})
    assert isinstance(other_base, Rejected) and "trained on tiny" in other_base.errors[0].reason
    as_tenant = await bus_submit_as(nc, "globex", {**base, "init_adapter": {"name": "capitals"}})
    assert isinstance(as_tenant, Rejected) and "no adapter named capitals" in as_tenant.errors[0].reason

    accepted = await submit(nc, {**base, "init_adapter": {"name": "capitals"}})
    assert isinstance(accepted, Accepted)
    kv = await nc.jetstream().key_value(names.JOBS_KV)
    stored = msgspec.json.decode((await kv.get(f"request.{accepted.job}")).value, type=StoredRequest)
    assert (stored.request.init_adapter.version, stored.request.init_adapter.peft) == (1, "j1/peft")


async def bus_submit_as(nc, tenant: str, request: dict):
    from schemas import names
    from schemas.jobs import SubmitReply
    from services import bus

    return await bus.request(nc, names.jobs_api(tenant).submit, msgspec.json.encode(request), SubmitReply)
