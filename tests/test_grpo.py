"""Reinforcement (grpo) through the native API, for real: the tiny model taught a little by SFT and registered,
then trained from that adapter on completions it samples itself, scored by a grader it rarely satisfies at first;
its events carry the rewards, its checkpoints the eval reward. And rft rows checked at upload, grpo jobs at
submit, each error naming its field."""

from __future__ import annotations

import time

import msgspec
import pytest

from schemas.dataset_check import DatasetInvalid, check_file
from schemas import names
from schemas.events import CheckpointList, Progress, ReinforcementMetrics, Samples
from schemas.graders import GradeResult
from schemas.jobs import Accepted, Rejected
from schemas.job_status import JobQuery
from services import bus, graders
from services.cli.watch import follow, progress_line
from services.transfer.sender import upload_dataset
from tests.conftest import get_job, submit, wait_for, wait_nodes, wait_state
from tests.qa import QA_PAIRS, pairs
from tests.test_dataset_formats import data_file
from trainer.errors import JobError

SAYS_PARIS = {
    "type": "string_check",
    "name": "says_paris",
    "input": "{{sample.output_text}}",
    "reference": "Paris",
    "operation": "like",
}
CAPITALS = [(q, a) for q, a in QA_PAIRS if "capital" in q]  # 8: only France's answer says Paris


def rft_rows(questions=CAPITALS) -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}], "answer": a} for q, a in questions]


def grpo_train(**more) -> dict:
    """What the end-to-end job trains with: 8 completions of 4 prompts a step, short, a little cooler than the
    policy, a KL term against the sft adapter it starts from."""
    return {
        "method": "grpo",
        "grader": SAYS_PARIS,
        "batch_size": 4,
        "group_size": 8,
        "max_completion_tokens": 16,
        "temperature": 0.7,
        "grpo_beta": 0.04,
        "learning_rate": 0.005,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "max_steps": 40,
        "max_seq_length": 128,
        "eval_steps": 10,
        "eval_samples": 8,
        "save_steps": 20,
        **more,
    }


async def test_grpo_after_sft_learns_what_the_grader_rewards(stack, nc, agents, tiny_model, tmp_path):
    started = time.monotonic()
    agents.start("cpu", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    await upload_dataset(nc, "capitals-rft", data_file(tmp_path / "rft.jsonl", "rft", rft_rows()).path)
    base = {"model": "tiny", "base_dir": str(tiny_model), "accelerator": "cpu"}
    await refused_at_submit(nc, base, tmp_path)

    sft_train = {"max_steps": 80, "learning_rate": 0.01, "batch_size": 1, "max_seq_length": 128, "warmup_steps": 0}
    sft = await submit(nc, {**base, "data": pairs(), "register": {"name": "capitals"}, "train": sft_train})
    assert isinstance(sft, Accepted), sft
    done = await wait_state(nc, sft.job, ("succeeded", "failed"), timeout=180)
    assert done.state == "succeeded", (done.message, agents.log("cpu")[-3000:])
    await wait_for(lambda: registered(nc, sft.job), timeout=30, what="the sft adapter's registration")

    grpo = await submit(
        nc,
        {
            **base,
            "dataset": {"name": "capitals-rft"},
            "validation_dataset": {"name": "capitals-rft"},
            "init_adapter": {"name": "capitals", "version": 1},
            "train": grpo_train(),
        },
    )
    assert isinstance(grpo, Accepted), grpo
    job = await wait_state(nc, grpo.job, ("succeeded", "failed"), timeout=300)
    assert job.state == "succeeded", (job.message, agents.log("cpu")[-3000:])
    events = [ev async for ev in follow(nc, grpo.job)]
    progress = [e for e in events if isinstance(e, Progress)]
    rewards = [p.reinforcement.reward for p in progress]
    print(f"grpo after sft: rewards by step {[round(r, 2) for r in rewards]}; {time.monotonic() - started:.0f} s")
    assert len(progress) == 40 and all(p.reinforcement is not None for p in progress)
    assert sum(rewards[:3]) / 3 <= 0.3, rewards  # it rarely says Paris at first: France's answer only
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
    last = progress[-1].reinforcement
    assert last.graders["says_paris"].mean == last.reward and last.pass_rate == last.reward  # scores are 0 or 1
    assert last.kl is not None and last.kl > 0 and last.grading_failures == 0 and last.rollouts_per_s > 0
    assert 0 < last.completion_tokens <= 16 and "reward" in progress_line(progress[-1])
    assert progress[-1].eval_reward is not None and progress[-1].eval_reward >= 0.8 and progress[-1].eval_loss is None

    graded = [e for e in events if isinstance(e, Samples)]
    assert [s.step for s in graded] == [10, 20, 30, 40] and all(x.score is not None for s in graded for x in s.samples)
    assert any("Paris" in x.answer and x.score == 1.0 for x in graded[-1].samples)
    checkpoints = (await bus.request(nc, names.CHECKPOINTS, JobQuery(grpo.job), CheckpointList)).checkpoints
    assert [c.step for c in checkpoints] == [20] and checkpoints[0].eval_reward is not None
    assert "the best eval reward" in job.message, job.message


async def registered(nc, job: str) -> bool:
    return "registered as capitals@1" in (await get_job(nc, job)).message


async def refused_at_submit(nc, base: dict, tmp_path) -> None:
    """A dataset of the wrong kind for the method is refused at submit, naming the field."""
    await upload_dataset(nc, "qa-pairs", data_file(tmp_path / "qa.jsonl", "qa", pairs(4)).path)
    for request, field, said in (
        ({"dataset": {"name": "qa-pairs"}, "train": grpo_train(eval_steps=0)}, "dataset.name", "name an rft dataset"),
        ({"dataset": {"name": "capitals-rft"}}, "dataset.name", "set train.method to grpo"),
    ):
        reply = await submit(nc, {**base, **request})
        assert isinstance(reply, Rejected) and reply.errors[0].field == field, reply
        assert said in reply.errors[0].reason, reply.errors[0].reason


def test_rft_rows_are_checked_at_upload(tmp_path):
    good = rft_rows()
    stats = check_file(data_file(tmp_path / "ok.jsonl", "rft", good).path)
    assert stats.format == "rft" and stats.rows == 8 and stats.roles == {"user": 8}
    multi_turn = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "answer": "Paris",
    }
    assert check_file(data_file(tmp_path / "multi.jsonl", "rft", [good[0], multi_turn]).path).format == "rft"
    with pytest.raises(DatasetInvalid, match="fits several formats"):  # could be chat, could be rft: --format says
        check_file(data_file(tmp_path / "either.jsonl", "rft", [multi_turn]).path)
    assert check_file(data_file(tmp_path / "either.jsonl", "rft", [multi_turn]).path, "rft").format == "rft"
    answered = {"messages": good[1]["messages"] + [{"role": "assistant", "content": "Tokyo."}], "answer": "x"}
    for broken, said in (
        (answered, "end with a assistant message; an rft row ends with the user turn"),
        ({"messages": []}, "messages is empty"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "message 1 has role 'robot'"),
        ({"messages": "What is the capital of France?"}, "messages: Expected `array`"),
    ):
        path = data_file(tmp_path / "bad.jsonl", "rft", [good[0], good[1], broken]).path
        with pytest.raises(DatasetInvalid, match=said) as e:
            check_file(path)
        assert "line 3" in str(e.value)


def test_grpo_jobs_are_checked_at_submit_naming_the_field():
    from schemas.job_checks import parse_job_request
    from schemas.validate import InvalidRequest

    job = {"model": "tiny", "base_dir": "/m", "dataset": {"name": "capitals-rft"}}
    grpo = {"method": "grpo", "grader": SAYS_PARIS}
    for changes, field, said in (
        ({"train": {"method": "grpo"}}, "train.grader", "grpo learns from a grader's scores"),
        ({"train": {"grader": SAYS_PARIS}}, "train.grader", "set train.method to grpo"),
        ({"train": {"group_size": 8}}, "train.group_size", "train.group_size is grpo's"),
        ({"train": {"temperature": 0.7}}, "train.temperature", "train.temperature is grpo's"),
        ({"train": {**grpo, "group_size": 1}}, "train.group_size", ">= 2"),
        ({"train": {**grpo, "max_completion_tokens": 1024}}, "train.max_completion_tokens", "no room for the prompt"),
        ({"data": pairs(2), "dataset": None, "train": grpo}, "data", "grpo trains on an rft dataset"),
        ({"devices": 2, "accelerator": "gpu", "train": grpo}, "devices", "on one device for now"),
        ({"train": {**grpo, "grader": {**SAYS_PARIS, "operation": "contains"}}}, "train.grader.operation", ""),
        ({"train": {**grpo, "grader": {**SAYS_PARIS, "input": "{{sample.output_txt}}"}}}, "train.grader.input", ""),
    ):
        with pytest.raises(InvalidRequest) as e:
            parse_job_request(msgspec.json.encode({**job, **changes}), graders.check)
        found = {err.field: err.reason for err in e.value.errors}
        assert field in found and said in found[field], (changes, e.value.errors)
    accepted = parse_job_request(msgspec.json.encode({**job, "train": grpo}), graders.check).train
    assert (accepted.group_size, accepted.max_completion_tokens, accepted.temperature) == (4, 64, 1.0)
    assert (accepted.grpo_beta, accepted.grpo_epsilon, accepted.eval_samples) == (0.0, 0.2, 16)


def test_a_row_without_a_field_the_grader_reads_fails_the_job_naming_its_line(tiny_model, tmp_path):
    from trainer.model import load
    from trainer.objectives.rft import read_prompts

    grader = graders_msg({**SAYS_PARIS, "reference": "{{item.answer}}"})
    rows = rft_rows()
    rows[2] = {"messages": rows[2]["messages"]}
    tok, _ = load(str(tiny_model), "cpu", __import__("torch").float32)
    path = data_file(tmp_path / "rft.jsonl", "rft", rows).path
    with pytest.raises(JobError, match="line 3 of the dataset has no answer, which train.grader reads"):
        read_prompts(path, tok, 100, grader)
    prompts = read_prompts(data_file(tmp_path / "ok.jsonl", "rft", rft_rows()).path, tok, 100, grader)
    assert len(prompts) == 8 and prompts.items[0]["answer"] == CAPITALS[0][1] and prompts.shown[0] == CAPITALS[0][0]
    with pytest.raises(JobError, match="line 1: the prompt takes .* raise max_seq_length"):
        read_prompts(path, tok, 5, grader)


def graders_msg(raw: dict):
    from schemas.graders import Grader

    return msgspec.convert(raw, Grader)


def test_the_reward_figures_count_failures_and_a_multi_graders_parts():
    import torch

    from trainer.objectives.reward_stats import RewardWindow
    from trainer.objectives.rollouts import Rollout

    multi = graders_msg(
        {
            "type": "multi",
            "name": "both",
            "calculate_output": "(a + b) / 2",
            "graders": {"a": SAYS_PARIS, "b": {**SAYS_PARIS, "reference": "capital"}},
        }
    )
    results = [
        GradeResult(score=1.0, sub_scores={"a": 1.0, "b": 1.0}),
        GradeResult(score=0.5, sub_scores={"a": 0.0, "b": 1.0}),
        GradeResult(score=0.0, error="the grader failed"),
    ]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    window = RewardWindow(multi)
    window.add(
        Rollout(torch.zeros((3, 5), dtype=torch.long), torch.ones((3, 5)), mask, torch.zeros(3), [], results, 2.0)
    )
    figures = window.report(with_kl=False)
    assert figures.reward == 0.5 and abs(figures.reward_std - 0.5) < 1e-9
    assert set(figures.graders) == {"both", "a", "b"} and figures.graders["a"].mean == 0.5
    assert figures.graders["b"].mean == 1.0 and figures.pass_rate == 1 / 3  # only 1.0 is above 0.5
    assert figures.grading_failures == 1 and figures.completion_tokens == 2.0 and figures.rollouts_per_s == 1.5
    assert figures.kl is None and RewardWindow(multi).report(with_kl=True) is None


def test_watch_prints_the_rewards():
    figures = ReinforcementMetrics(
        reward=0.5, reward_std=0.1, pass_rate=0.5, kl=0.002, completion_tokens=4.0, rollouts_per_s=9.0
    )
    line = progress_line(Progress(step=3, steps=9, loss=0.01, eval_reward=0.75, reinforcement=figures))
    assert "eval reward 0.750" in line and "reward 0.500±0.100" in line and "kl 0.0020" in line, line


def test_a_reward_is_better_higher_for_keeping_the_best_and_stopping_early():
    from trainer.job.best import BestEval

    best = BestEval(patience=2, min_delta=0.01, higher=True)
    for step, reward in ((10, 0.25), (20, 0.5), (30, 0.505), (40, 0.4)):
        best.observe(step, reward, model=None)  # nothing kept: no weights to copy
    assert (best.step, best.loss) == (20, 0.5) and best.should_stop
    assert "the eval reward did not improve by more than 0.01 for 2 evaluations (best 0.5000 at step 20)" in (
        best.why_stopped(0.01)
    )


HOSTILE = '''import os, socket

def grade(sample, item):
    """1.0 when nothing of the node reached this grader; a 10 GiB allocation where the item asks for one."""
    if item.get("hostile") == "alloc":
        bytearray(10 << 30)
    leaks = 0
    try:
        socket.create_connection(("127.0.0.1", int(item["nats_port"])), timeout=2).close()
        leaks += 1
    except OSError:
        pass
    leaks += any(k.startswith(("JETLORA", "NATS")) for k in os.environ)
    try:
        open(item["creds"]).read()
        leaks += 1
    except OSError:
        pass
    return 1.0 if leaks == 0 else 0.0
'''


async def test_a_hostile_python_grader_is_contained_and_the_job_and_node_go_on(stack, nc, agents, tiny_model, tmp_path):
    """In a real job: a grader that tries the bus's port, the trainer's environment and a credentials file finds
    none of them (every such sample scores 1.0), one that allocates 10 GiB scores 0 and is counted; the job ends
    and its node still heartbeats."""
    if not graders.status().isolated:
        pytest.skip(f"no sandbox here: {graders.status().why_not}")
    creds = tmp_path / "agent.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\nsecret\n")
    creds.chmod(0o600)
    port = nc.connected_url.port
    rows = [
        {**row, "nats_port": port, "creds": str(creds), "hostile": "alloc" if k % 2 else "probe"}
        for k, row in enumerate(rft_rows())
    ]
    agents.start("cpu", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    await upload_dataset(nc, "hostile-rft", data_file(tmp_path / "rft.jsonl", "rft", rows).path)
    grader = {"type": "python", "name": "hostile", "source": HOSTILE}
    train = {**grpo_train(), "grader": grader, "batch_size": 8, "group_size": 2, "max_steps": 2}
    train.update(max_completion_tokens=4, eval_steps=0, save_steps=0, grpo_beta=0.0)
    base = {"model": "tiny", "base_dir": str(tiny_model), "accelerator": "cpu"}
    reply = await submit(nc, {**base, "dataset": {"name": "hostile-rft"}, "train": train})
    assert isinstance(reply, Accepted), reply
    job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=240)
    assert job.state == "succeeded", (job.message, agents.log("cpu")[-3000:])
    progress = [e for e in [ev async for ev in follow(nc, reply.job)] if isinstance(e, Progress)]
    assert len(progress) == 2
    for p in progress:  # 8 prompts x 2 completions a step: the 8 of the alloc rows failed, the 8 others found nothing
        assert p.reinforcement.grading_failures == 8 and p.reinforcement.reward == 0.5, p.reinforcement
    await wait_nodes(nc, 1)  # the node is still there, heartbeating
