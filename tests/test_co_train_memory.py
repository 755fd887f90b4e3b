"""What a co-training group's step holds when its members' lengths differ (issue #54): the members' rows go end to
end (trainer/co_train/combine.py's flat layout), so a group of short jobs beside one long one holds what each job's
own batch holds, which is what the scheduler's group estimate adds up (schemas/co_train.py group_estimate); padded
to the widest member it would hold ten times that. Measured in a fresh process as bench/memory_estimate.py measures
a job alone (the RSS growth from just before the model is loaded, over two group steps; large blocks unmapped when
freed, so that RSS is what the tensors hold): within the estimate + 10%. The peak is the process image's own (VmHWM),
never ru_maxrss: Linux folds the parent's peak into a child's ru_maxrss at exec, so under a pytest worker grown by
the tests before it (the full suite, -n 2) the group "peaked" at 517-577 MiB against its own ~290.
And the flat layout's output for each member is its own batch's (to float rounding: its attention is computed
sequence by sequence, trainer/multi_lora/varlen.py, where its own batch masks whole rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import torch

from schemas.co_train import group_estimate
from schemas.memory import estimate
from schemas.events import TrainerSpec
from schemas.jobs import JobRequest
from services.agent.models import read_shape
from tests.qa import QA_PAIRS

ROOT = Path(__file__).resolve().parent.parent
SHORT, LONG = (8, 64), (1, 1024)  # (rows, max_seq_length): three short jobs beside one long one
MMAP_THRESHOLD = 128 * 1024
HELD_MIB = 768  # what a grown pytest worker holds, about
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def mixed_requests(model_dir: str, short: int = 3) -> list[JobRequest]:
    """`short` jobs of 8 packed rows of up to 64 tokens a step, and one of 1 row of up to 1,024 (the Q/A pairs, many
    times over)."""
    data = [{"q": q, "a": a} for _ in range(40) for q, a in QA_PAIRS]
    out = []
    for rows, seq in [SHORT] * short + [LONG]:
        train = {"batch_size": rows, "max_seq_length": seq, "max_steps": 3, "precision": "fp32", "seed": len(out)}
        request = {
            "model": "m",
            "base_dir": model_dir,
            "data": data,
            "train": train,
            "lora": {"target_modules": TARGETS},
        }
        out.append(msgspec.convert(request, JobRequest))
    return out


def measure(model_dir: str, out_dir: str, jobs: list[int] | None, flat: bool = True) -> dict:
    """In this (fresh) process: the base, the jobs of mixed_requests numbered `jobs` (None: the base alone) in one
    group, two group steps; the MiB the process grew by at its peak from just before the model was loaded, and the
    token positions each step held."""
    from trainer.co_train.group import CoTrainer
    from trainer.model import load

    torch.set_num_threads(2)
    before = resident_mib("VmRSS")
    tokenizer, model = load(model_dir, "cpu", torch.float32)
    group = CoTrainer(model, tokenizer, flat=flat)
    requests = mixed_requests(model_dir)
    for i in jobs or []:
        group.add_job(TrainerSpec(job=f"j{i}", attempt=1, request=requests[i], out_dir=f"{out_dir}/j{i}"))
    positions = []
    for _ in range(2 if jobs else 0):
        group.step()
        positions.append(group.last_positions)
    return {"peak_mib": resident_mib("VmHWM") - before, "positions": positions}


def resident_mib(field: str) -> float:
    """This process's resident memory now (VmRSS) or at its peak (VmHWM), in MiB. VmHWM is this process image's
    own peak; ru_maxrss is not: at exec the kernel keeps the old image's peak in it (exec_mmap), and a child forked
    (or vforked) from a process holding 900 MiB starts out "peaking" at 900 MiB, whatever it does itself."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1]) / 1024


def in_fresh_process(model_dir: str, out_dir: str, jobs: list[int] | None, flat: bool = True) -> dict:
    """measure() in a process of its own, whose large blocks glibc maps and unmaps as they come and go (so that its
    RSS is what its tensors hold, not what the allocator keeps after they are freed)."""
    code = (
        "import json; from tests.test_co_train_memory import measure; "
        f"print(json.dumps(measure({model_dir!r}, {out_dir!r}, {jobs!r}, {flat!r})))"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def big_model(tmp: Path) -> str:
    """A model whose activations, not the interpreter, make the peak (hidden 256, 4 layers, 688 wide MLPs)."""
    from tests.conftest import tinymodel

    texts = [f"{q} {a}" for q, a in QA_PAIRS]
    return str(tinymodel().build(tmp / "m", texts, hidden=256, layers=4, heads=4, kv_heads=4, intermediate=688))


def test_a_group_of_mixed_lengths_holds_what_its_estimate_adds_up(tmp_path):
    model_dir = big_model(tmp_path)
    requests = mixed_requests(model_dir)
    shape = read_shape(model_dir)
    estimated = group_estimate(shape, requests, "cpu")
    group = in_fresh_process(model_dir, str(tmp_path), [0, 1, 2, 3])
    assert max(group["positions"]) <= sum(estimate(shape, r, "cpu").tokens for r in requests)  # no row padded
    assert group["peak_mib"] <= 1.10 * estimated.mib, (group, estimated)
    print(f"mixed lengths: group peak {group['peak_mib']:.0f} MiB, its estimate {estimated.mib} MiB")


def test_the_peak_is_the_fresh_processs_own_whatever_its_parent_holds(tmp_path):
    """Beside other tests a pytest worker grows: the fresh process's peak is still what it holds itself (ru_maxrss
    carried the worker's into it across exec, and the group test failed in the full suite)."""
    model_dir = big_model(tmp_path)
    held = bytearray(HELD_MIB * 2**20)
    held[:: 2**12] = bytes(len(held) // 2**12)  # every page written: resident in this process
    assert resident_mib("VmRSS") > HELD_MIB
    loaded = in_fresh_process(model_dir, str(tmp_path), None)
    del held
    assert loaded["peak_mib"] < HELD_MIB / 4, loaded  # what loading the model takes, not what this process held
    print(f"the base loaded: {loaded['peak_mib']:.0f} MiB, in a process started by one holding {HELD_MIB} MiB")


def test_the_flat_layout_gives_each_member_its_own_batchs_output(tiny_model):
    """Packed rows (sequences restarting within a row), a padded batch, rows of other widths, two members of one
    shape: laid end to end in one row, each member's output is what its own batch gives on its own (its real
    tokens), to float rounding: attention goes sequence by sequence, in buckets of about one length, rather than
    row by row under a mask."""
    from trainer.co_train.combine import combine
    from trainer.multi_lora.layer import Routing
    from trainer.multi_lora.shared_base import SharedBase
    from trainer.data.examples import Batch
    from trainer.model import load

    tokenizer, model = load(str(tiny_model), "cpu", torch.float32)
    base = SharedBase(model)
    torch.manual_seed(0)
    ids = lambda rows, width: torch.randint(5, 300, (rows, width))  # noqa: E731
    packed = Batch(ids(2, 7), ids(2, 7), torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]]), None, 14)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    padded = Batch(ids(3, 5), ids(3, 5), None, mask, 11)
    wide = Batch(ids(1, 40), ids(1, 40), torch.arange(40)[None], None, 40)
    twin = Batch(ids(2, 7), ids(2, 7), torch.tensor([[0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0]]), None, 14)
    long = Batch(ids(1, 300), ids(1, 300), torch.cat([torch.arange(170), torch.arange(130)])[None], None, 300)
    members = {"packed": packed, "twin": twin, "padded": padded, "wide": wide, "long": long}
    combined = combine(members, tokenizer.pad_token_id, model)
    assert combined.layout is not None and combined.batch.input_ids.shape == (1, 14 + 14 + 15 + 40 + 300)
    assert {width for _, width in combined.layout.buckets} == {16, 48, 160, 192}  # 170 tokens: 192, 130: 160
    with torch.no_grad(), base.routed(Routing()):
        together = base.output(combined.batch, combined.layout)
        for name, own in members.items():
            alone = base.output(own)
            real = own.attention_mask.bool() if own.attention_mask is not None else slice(None)
            torch.testing.assert_close(combined.out_of(together, name)[real], alone[real], atol=1e-5, rtol=1e-5)
