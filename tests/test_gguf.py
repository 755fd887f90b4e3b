"""The GGUF LoRA adapter, read back with gguf's own reader: keys, names, shapes and values."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import msgspec
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import spec_for
from trainer.errors import JobError
from trainer.__main__ import main as trainer_main
from trainer.gguf_export import check_exportable, export_adapter, permute
from trainer.job.loop import train


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    return Path(train(spec_for(tiny_model, tmp, max_steps=3)).adapter_dir)


def field_value(reader, key):
    f = reader.fields[key]
    return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]]


def test_gguf_adapter_matches_the_peft_tensors(tiny_model, adapter, tmp_path):
    out = export_adapter(adapter, tiny_model, tmp_path / "a.gguf", "f32")
    reader = gguf.GGUFReader(out)
    assert field_value(reader, "general.architecture") == "llama"
    assert field_value(reader, "general.type") == "adapter"
    assert field_value(reader, "adapter.type") == "lora"
    assert float(field_value(reader, "adapter.lora.alpha")) == 32.0

    peft = load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == len(peft) == 2 * 2 * 7  # 2 layers x 7 projections x (a, b)
    a = tensors["blk.0.attn_v.weight.lora_a"]
    b = tensors["blk.0.attn_v.weight.lora_b"]
    pa = peft["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"]
    pb = peft["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"]
    # GGUF shapes are ggml's (reversed): lora_a ne = [in, r], lora_b ne = [r, out], as llama-adapter.cpp checks
    assert list(a.shape) == [pa.shape[1], pa.shape[0]] and list(b.shape) == [pb.shape[1], pb.shape[0]]
    assert np.array_equal(np.asarray(a.data).reshape(pa.shape), pa)
    assert np.array_equal(np.asarray(b.data).reshape(pb.shape), pb)
    qb = peft["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    got = np.asarray(tensors["blk.1.attn_q.weight.lora_b"].data).reshape(qb.shape)
    assert np.array_equal(got, permute(qb, config["num_attention_heads"]))
    kb = peft["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"]
    got = np.asarray(tensors["blk.1.attn_k.weight.lora_b"].data).reshape(kb.shape)
    assert np.array_equal(got, permute(kb, config["num_key_value_heads"]))
    assert "blk.1.ffn_down.weight.lora_a" in tensors and "blk.1.ffn_gate.weight.lora_b" in tensors


def test_f16_is_the_default_type(tiny_model, adapter, tmp_path):
    reader = gguf.GGUFReader(export_adapter(adapter, tiny_model, tmp_path / "a.gguf"))
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F16}


def test_an_architecture_gguf_does_not_know_is_named(tiny_model, adapter, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    config["model_type"] = "made_up_arch"
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(JobError, match="made_up_arch"):
        export_adapter(adapter, base, tmp_path / "a.gguf")


def base_of_type(tiny_model, tmp_path, model_type: str) -> Path:
    """The tiny model's config under another model_type (the export reads only the config)."""
    base = tmp_path / model_type
    base.mkdir()
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    config["model_type"] = model_type
    (base / "config.json").write_text(json.dumps(config))
    return base


def test_names_and_base_model_are_recorded_as_llama_cpp_records_them(tiny_model, adapter, tmp_path):
    reader = gguf.GGUFReader(
        export_adapter(adapter, tiny_model, tmp_path / "a.gguf", name="tiny LoRA j1", base_model="tiny")
    )
    assert field_value(reader, "general.name") == "tiny LoRA j1"
    assert int(field_value(reader, "general.base_model.count")) == 1
    assert field_value(reader, "general.base_model.0.name") == "tiny"


@pytest.mark.parametrize("model_type, permuted", [("olmo", True), ("granite", True), ("qwen2", False)])
def test_q_and_k_are_permuted_for_every_architecture_llama_cpp_permutes(
    tiny_model, adapter, tmp_path, model_type, permuted
):
    reader = gguf.GGUFReader(
        export_adapter(adapter, base_of_type(tiny_model, tmp_path, model_type), tmp_path / "a.gguf", "f32")
    )
    peft = load_file(str(adapter / "adapter_model.safetensors"))
    heads = json.loads((Path(tiny_model) / "config.json").read_text())["num_attention_heads"]
    qb = peft["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    got = np.asarray(next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight.lora_b").data).reshape(qb.shape)
    assert np.array_equal(got, permute(qb, heads) if permuted else qb)


def test_an_unverified_architecture_is_refused_before_training(tiny_model, tmp_path, capsys):
    check_exportable(tiny_model)  # llama: verified
    check_exportable(base_of_type(tiny_model, tmp_path, "qwen2"))
    with pytest.raises(JobError, match="served_by=vllm"):
        check_exportable(base_of_type(tiny_model, tmp_path, "internlm2"))

    spec = spec_for(tiny_model, tmp_path)
    spec.request.served_by = "llamacpp"
    spec.request.base_dir = str(base_of_type(tiny_model, tmp_path, "minicpm"))
    job_file = tmp_path / "job.json"
    job_file.write_bytes(msgspec.json.encode(spec))
    assert trainer_main(["trainer", str(job_file)]) == 1
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [e["type"] for e in events] == ["failed"] and "minicpm" in events[0]["message"]  # no step was trained
