"""A job's peak memory predicted from its model's config: agents advertise their models' shapes, `gpu_mib: 0` jobs
are sized by it, and a job no device can hold is refused with the estimate and what would make it fit."""

from __future__ import annotations

import json

import msgspec

from schemas.jobs import Accepted, JobRequest, Rejected
from schemas.memory import ModelShape, estimate
from services.agent.models import read_shape
from tests.conftest import get_job, submit, wait_for, wait_nodes, wait_state
from tests.qa import pairs

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "model_type": "llama",
}


def request(base_dir, **train) -> JobRequest:
    return msgspec.convert({"model": "m", "base_dir": str(base_dir), "data": pairs(2), "train": train}, JobRequest)


def test_the_shape_of_a_known_model_and_what_lowers_its_estimate(tiny_model):
    shape = ModelShape.from_config("/models/llama-3-8b", LLAMA_3_8B)
    assert shape.params == 8_030_261_248  # Llama 3 8B's published parameter count, counted from its config
    tiny = read_shape(str(tiny_model))  # from the safetensors headers
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        assert tiny.params == sum(
            f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape() + [1])[1] for k in f.keys()
        )

    base = estimate(shape, request("/m", batch_size=4, max_seq_length=4096))
    lower = {
        "gradient checkpointing": estimate(
            shape, request("/m", batch_size=4, max_seq_length=4096, gradient_checkpointing=True)
        ),
        "batch 1": estimate(shape, request("/m", batch_size=1, max_seq_length=4096)),
        "chunked loss of 256": estimate(shape, request("/m", batch_size=4, max_seq_length=4096, loss_chunk_tokens=256)),
        "nf4": estimate(
            shape, msgspec.structs.replace(request("/m", batch_size=4, max_seq_length=4096), quantization="nf4")
        ),
    }
    for what, est in lower.items():
        assert est.mib < base.mib, (what, est, base)
    assert estimate(shape, request("/m", batch_size=4, max_seq_length=4096, loss_chunk_tokens=0)).mib > base.mib
    assert 15_000 < base.weights_mib < 15_500  # 8.03B parameters in bf16


async def test_an_auto_sized_job_is_placed_by_its_estimate_or_refused_with_what_to_change(
    stack, nc, agents, tiny_model, tmp_path
):
    big = tmp_path / "llama-3-8b"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(LLAMA_3_8B))
    agents.start("n1", gpus="24576", hold_s=60, extra=("--model", str(big), "--model", str(tiny_model)))
    await wait_nodes(nc, 1)

    too_big = {
        "model": "llama",
        "base_dir": str(big),
        "data": pairs(2),
        "train": {"batch_size": 4, "max_seq_length": 4096},
    }
    reply = await submit(nc, too_big)
    assert isinstance(reply, Rejected) and reply.errors[0].field == "gpu_mib", reply
    why = reply.errors[0].reason
    need = estimate(read_shape(str(big)), msgspec.convert(too_big, JobRequest)).mib
    assert f"needs ~{need:,} MiB" in why and "largest free is 24,576 MiB (n1 device 0)" in why, why
    assert "set train.gradient_checkpointing" in why and "set quantization to nf4" in why, why
    print(why)

    fits = {**too_big, "train": {"batch_size": 1, "max_seq_length": 4096, "gradient_checkpointing": True}}
    reply = await submit(nc, fits)
    assert isinstance(reply, Accepted), reply
    sized = estimate(read_shape(str(big)), msgspec.convert(fits, JobRequest)).mib
    job = await wait_state(nc, reply.job, "running")
    assert (await get_job(nc, reply.job)).gpu_mib == sized and 20_000 < sized <= 24_576, sized
    assert job.node == "n1"

    # a model no node advertises keeps the old meaning of gpu_mib 0: any free GPU (here: none is free)
    unknown = await submit(nc, {"model": "x", "base_dir": "/models/elsewhere", "data": pairs(2)})
    assert isinstance(unknown, Accepted) and (await get_job(nc, unknown.job)).gpu_mib == 0
    await wait_for(lambda: _queued(nc, unknown.job), what="the unsized job waiting")


async def _queued(nc, job: str) -> bool:
    return (await get_job(nc, job)).state == "queued"


def test_the_estimate_command_reads_the_model_here_and_says_what_would_fit(tmp_path, capsys):
    from schemas.memory import Estimate
    from services.cli import main

    big = tmp_path / "llama-3-8b"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(LLAMA_3_8B))
    job = {
        "model": "llama",
        "base_dir": "/models/elsewhere",
        "data": pairs(2),
        "train": {"batch_size": 4, "max_seq_length": 4096},
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert main(["estimate", str(tmp_path / "job.json"), "--model-dir", str(big), "--json"]) == 0
    printed = msgspec.json.decode(capsys.readouterr().out, type=Estimate)
    assert printed == estimate(read_shape(str(big)), msgspec.convert(job, JobRequest))
    assert main(["estimate", str(tmp_path / "job.json"), "--model-dir", str(big), "--free", "24576"]) == 0
    out = capsys.readouterr().out
    assert f"~{printed.mib:,} MiB per device" in out and "both: ~" in out and "(still too much)" in out, out
    assert main(["estimate", str(tmp_path / "job.json")]) == 2  # /models/elsewhere is not on this machine
    assert "give --model-dir" in capsys.readouterr().err


def test_a_co_training_group_holds_the_base_once_and_each_jobs_own_state(tmp_path, capsys):
    from schemas.co_train import GroupEstimate, group_estimate, own_mib
    from services.cli import main

    big = tmp_path / "llama-3-8b"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(LLAMA_3_8B))
    shape = read_shape(str(big))
    jobs = [request(big, batch_size=b, max_seq_length=512) for b in (1, 2, 4)]
    jobs[2] = msgspec.structs.replace(jobs[2], lora=msgspec.structs.replace(jobs[2].lora, r=64))
    group = group_estimate(shape, jobs)
    alone = [estimate(shape, r) for r in jobs]
    assert group.own_mib == [own_mib(n) for n in alone]  # each job's part is what it would take alone less the base
    assert group.mib == group.base_mib + sum(group.own_mib)
    assert group.base_mib > alone[0].weights_mib  # the weights with the allocator's margin, and the CUDA context
    saved = sum(n.mib for n in alone) - group.mib
    assert abs(saved - 2 * group.base_mib) <= 3, (saved, group.base_mib)  # two copies of the base fewer, to rounding

    files = []
    for i, r in enumerate(jobs):
        files.append(str(tmp_path / f"job{i}.json"))
        (tmp_path / f"job{i}.json").write_bytes(msgspec.json.encode(r))
    assert main(["estimate", *files, "--model-dir", str(big), "--json"]) == 0
    assert msgspec.json.decode(capsys.readouterr().out, type=GroupEstimate) == group
    alone_file = tmp_path / "alone.json"
    alone_file.write_bytes(msgspec.json.encode(msgspec.structs.replace(jobs[0], co_train=False)))
    assert main(["estimate", files[0], str(alone_file), "--model-dir", str(big)]) == 2
    assert "asked to train alone (co_train: false)" in capsys.readouterr().err
