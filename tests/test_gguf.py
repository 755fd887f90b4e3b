"""The GGUF LoRA adapter, read back with gguf's own reader: keys, names, shapes and values."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import spec_for
from trainer.errors import JobError
from trainer.gguf_export import export_adapter, permute
from trainer.loop import train


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
