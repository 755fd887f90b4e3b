"""4-bit QLoRA (quantization: nf4) is GPU-only: refused at submit without a GPU in the fleet or on a CPU job, by
an agent asked to run it on its CPU, and by the trainer on a CPU, each naming the fix. (The GPU path itself runs
only where a CUDA device and bitsandbytes are present; see the closing note of issue 12.)"""

from __future__ import annotations

import msgspec

from schemas import names
from schemas.jobs import JobRequest, Rejected
from schemas.nodes import Assignment, AssignRefused, AssignReply
from services import bus
from tests.conftest import spec_for, submit, wait_nodes
from tests.qa import pairs
from tests.test_trainer import bad

NF4 = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "quantization": "nf4"}


async def test_nf4_is_refused_at_submit_without_a_gpu(stack, nc, agents):
    cpu_job = await submit(nc, {**NF4, "accelerator": "cpu"})
    assert isinstance(cpu_job, Rejected) and cpu_job.errors[0].field == "quantization"
    assert "needs a GPU" in cpu_job.errors[0].reason
    agents.start("cpu-only", gpus=None, offer_cpu=True)
    await wait_nodes(nc, 1)
    no_gpu = await submit(nc, NF4)
    assert isinstance(no_gpu, Rejected) and no_gpu.errors[0].field == "quantization"
    assert "no known node has a GPU" in no_gpu.errors[0].reason

    request = msgspec.convert(NF4, JobRequest)  # as if the scheduler had placed it on the node's CPU (its term)
    placed = Assignment(job="j1", device=-1, attempt=1, request=request, term=stack.core.term)
    reply = await bus.request(nc, names.node("cpu-only").assign, placed, AssignReply)
    assert isinstance(reply, AssignRefused) and "nf4 (4-bit) training needs a GPU" in reply.reason


def test_the_trainer_refuses_nf4_on_a_cpu_naming_the_fix(tiny_model, tmp_path, capsys):
    spec = spec_for(tiny_model, tmp_path)
    spec = msgspec.structs.replace(spec, request=msgspec.structs.replace(spec.request, quantization="nf4"))
    message = bad(tmp_path, capsys, spec)
    assert "quantization nf4 needs a CUDA GPU" in message and "quantization 'none'" in message
