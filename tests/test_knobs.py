"""The knobs the seed's users expect, for real on the tiny model: each LoRA initialiser trains and its adapter loads
in PEFT (pissa's as a plain LoRA of the original base, GGUF included), each optimizer's loss falls, what needs a GPU
is refused at submit, and W&B (offline) and MLflow (a file store) receive every step's loss."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import msgspec
import pytest
import torch

from schemas.events import Progress, TrainerSpec
from schemas.job_checks import parse_job_request
from schemas.jobs import JobRequest, Rejected
from schemas.memory import ModelShape, estimate
from schemas.training import LoraConfig as LoraSpec
from schemas.validate import InvalidRequest
from tests.conftest import submit
from tests.qa import pairs
from tests.test_trainer import events_from
from services.registry.service import stored_rank
from trainer.adapter_init import save_plain_lora
from trainer.job.loop import train

SHORT = {
    "max_steps": 30,
    "learning_rate": 0.01,
    "batch_size": 1,
    "max_seq_length": 128,
    "warmup_steps": 0,
    "logging_steps": 1,
}


def spec(model_dir, tmp_path, lora=None, integrations=(), **train_changes) -> TrainerSpec:
    req = msgspec.convert(
        {
            "model": "tiny",
            "base_dir": str(model_dir),
            "data": pairs(),
            "train": {**SHORT, **train_changes},
            "lora": lora or {},
            "integrations": list(integrations),
            "label": "knobs",
        },
        JobRequest,
    )
    return TrainerSpec(job="knobs", attempt=1, request=req, out_dir=str(tmp_path / "out"))


def losses(capsys) -> list[float]:
    return [e.loss for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)]


def logits(model_dir, adapter_dir=None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        return model(torch.tensor([[5, 17, 42, 99, 3, 8]])).logits


@pytest.mark.parametrize("init", ["default", "gaussian", "pissa"])
def test_each_initialiser_trains_and_its_adapter_loads_in_peft(tiny_model, tmp_path, capsys, init):
    finished = train(spec(tiny_model, tmp_path, lora={"init": init, "r": 4}))
    curve = losses(capsys)
    assert finished.state == "trained" and curve[-1] < curve[0], curve
    config = json.loads((Path(finished.adapter_dir) / "adapter_config.json").read_text())
    assert config["r"] == (8 if init == "pissa" else 4)  # pissa's is stored as a LoRA of 2r on the original base
    assert config["init_lora_weights"] in (True, "gaussian")
    changed = logits(tiny_model, finished.adapter_dir)
    assert not torch.allclose(logits(tiny_model), changed, atol=1e-4)


@pytest.mark.parametrize("init", ["pissa", "loftq"])
def test_a_mutating_start_is_saved_as_the_same_model_on_the_original_base(tiny_model, tmp_path, init):
    """What the trained model computes (its changed base plus the adapter) equals the original base plus the saved
    plain adapter. loftq's start needs CUDA, so its base change is made here by hand the way peft makes it (the
    base loses B0 A0, unscaled); the conversion is the part under test."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    lo = msgspec.convert(
        {"init": init, "r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}, LoraSpec
    )
    model = get_peft_model(
        base,
        LoraConfig(
            r=4,
            lora_alpha=8.0,
            target_modules=list(lo.target_modules),
            init_lora_weights="pissa" if init == "pissa" else True,
        ),
    )
    from peft import get_peft_model_state_dict

    if init == "loftq":
        for module in model.modules():
            if hasattr(module, "lora_B") and "default" in getattr(module, "lora_B", {}):
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                with torch.no_grad():
                    b.normal_(0, 0.05)
                    module.get_base_layer().weight -= b @ a
    initial = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    with torch.no_grad():  # "training"
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
        ids = torch.tensor([[5, 17, 42, 99, 3, 8]])
        trained = model(ids).logits
    out = save_plain_lora(model, tmp_path / "adapter", initial, lo)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == stored_rank(lo) == (8, 16.0)  # what the registry records
    assert torch.allclose(logits(tiny_model, out), trained, atol=1e-4)


def test_a_pissa_adapter_exports_to_gguf_at_rank_2r(tiny_model, tmp_path):
    from trainer.gguf_export import export_adapter

    finished = train(spec(tiny_model, tmp_path, lora={"init": "pissa", "r": 4}, max_steps=2))
    reader = gguf.GGUFReader(export_adapter(finished.adapter_dir, tiny_model, tmp_path / "a.gguf", "f32"))
    a = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight.lora_a")
    assert 8 in list(a.shape)


@pytest.mark.parametrize(
    "optimizer, extra",
    [
        ("adamw", {"adam_betas": [0.8, 0.99], "adam_eps": 1e-6}),
        ("adafactor", {}),
        ("sgd", {"momentum": 0.9, "learning_rate": 0.05}),
    ],
)
def test_each_optimizer_lowers_the_loss(tiny_model, tmp_path, capsys, optimizer, extra):
    finished = train(spec(tiny_model, tmp_path, optimizer=optimizer, **extra))
    curve = losses(capsys)
    assert finished.state == "trained"
    assert sum(curve[-5:]) / 5 < 0.8 * sum(curve[:5]) / 5, (optimizer, curve)


def test_what_needs_a_gpu_and_settings_that_do_not_apply_are_refused_naming_the_field():
    job = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1)}
    cases = [
        ({"accelerator": "cpu", "train": {"optimizer": "adamw_8bit"}}, "train.optimizer"),
        ({"accelerator": "cpu", "lora": {"init": "loftq"}}, "lora.init"),
        ({"quantization": "nf4", "lora": {"init": "pissa"}}, "lora.init"),
        ({"train": {"momentum": 0.9}}, "train.momentum"),
        ({"train": {"optimizer": "sgd", "adam_eps": 1e-6}}, "train.adam_eps"),
        ({"lora": {"init": "pissa", "r": 512}}, "lora.r"),
    ]
    for changes, field in cases:
        with pytest.raises(InvalidRequest) as e:
            parse_job_request(msgspec.json.encode({**job, **changes}))
        assert field in [f.field for f in e.value.errors], (changes, e.value.errors)
    assert parse_job_request(msgspec.json.encode({**job, "train": {"optimizer": "adamw_8bit"}})).train.optimizer


async def test_8bit_adamw_on_a_cpu_job_is_refused_at_submit(nc, stack):
    reply = await submit(
        nc,
        {
            "model": "tiny",
            "base_dir": "/models/tiny",
            "data": pairs(1),
            "accelerator": "cpu",
            "train": {"optimizer": "adamw_8bit"},
        },
    )
    assert isinstance(reply, Rejected) and reply.errors[0].field == "train.optimizer", reply
    assert "GPU" in reply.errors[0].reason


def test_the_memory_estimate_counts_each_optimizers_state(tiny_model):
    shape = ModelShape.from_config(str(tiny_model), json.loads((Path(tiny_model) / "config.json").read_text()))

    def lora_mib(**train) -> int:
        req = msgspec.convert(
            {"model": "m", "base_dir": "/m", "data": pairs(1), "lora": {"r": 256}, "train": train}, JobRequest
        )
        return estimate(shape, req).lora_mib

    adamw, eight, sgd, plain_sgd, adafactor = (
        lora_mib(),
        lora_mib(optimizer="adamw_8bit"),
        lora_mib(optimizer="sgd", momentum=0.9),
        lora_mib(optimizer="sgd"),
        lora_mib(optimizer="adafactor"),
    )
    assert adamw > eight > plain_sgd and adamw > sgd > plain_sgd and adafactor < sgd, (adamw, eight, sgd, adafactor)
    assert math.isclose(adamw / plain_sgd, 16 / 8, rel_tol=0.05)


def wandb_records(path: Path):
    """The records of a .wandb file: W&B's header, then LevelDB's log format (32 KiB blocks of records, each with a
    crc32, a length and a type: whole, first, middle or last piece). The wandb package reads it in Go only now."""
    import struct
    import zlib

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, piece = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + body) & 0xFFFFFFFF == crc, f"a damaged record at byte {pos}"
        pos += 7 + length
        piece = body if kind in (1, 2) else piece + body
        if kind in (1, 4) and piece:
            yield piece


def wandb_losses(run_dir: Path) -> dict[int, float]:
    """Every history row's train/loss in the offline run's own .wandb file."""
    from wandb.proto import wandb_internal_pb2

    found: dict[int, float] = {}
    for data in wandb_records(next(run_dir.glob("wandb/offline-run-*/run-*.wandb"))):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if "train/loss" in row:
                found[int(row["_step"])] = row["train/loss"]
    return found


def test_wandb_offline_and_mlflow_on_a_file_store_receive_every_steps_loss(tiny_model, tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")  # the node's settings: nothing leaves it
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants this for a file: store (kept, not developed)
    store = f"file://{tmp_path / 'mlruns'}"
    finished = train(
        spec(
            tiny_model,
            tmp_path,
            max_steps=12,
            integrations=[
                {"type": "wandb", "project": "jetlora-test", "tags": ["ci"]},
                {"type": "mlflow", "tracking_uri": store, "experiment": "knobs"},
            ],
        )
    )
    published = {e.step: e.loss for e in events_from(capsys.readouterr().out) if isinstance(e, Progress)}
    assert finished.state == "trained" and sorted(published) == list(range(1, 13))

    client = MlflowClient(tracking_uri=store)
    run = client.search_runs([client.get_experiment_by_name("knobs").experiment_id])[0]
    assert run.data.tags["jetlora.job"] == "knobs" and run.data.params["train.optimizer"] == "adamw"
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert logged.keys() == published.keys()
    assert all(math.isclose(logged[s], published[s], rel_tol=1e-6) for s in published)

    from_wandb = wandb_losses(Path(finished.adapter_dir).parent)
    assert from_wandb.keys() == published.keys(), from_wandb
    assert all(math.isclose(from_wandb[s], published[s], rel_tol=1e-6) for s in published)
    assert not os.environ.get("WANDB_API_KEY")  # nothing needed one
