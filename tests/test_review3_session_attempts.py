"""Review of 3ab2216 (#63): the gateway tells a session's next training call a loss when the attempt its calls went to
did not end in a pause (JobSummary.paused_attempts). A sample (a sampling client of the model's saved weights: no
order, no state changed) that resumes a paused session is sent to the resumed attempt; the gateway took that attempt
as the one "its calls went to", so the node's loss before any training call reached it was told as a loss, though
the attempt after goes on from the pause's checkpoint with every call kept. Told to load_state its last save, the
client would throw away the steps the pause kept. Real stack: nats-server, the scheduler, an agent as a process with
the real session trainer, the official client."""

from __future__ import annotations

import asyncio
import os

import pytest

from schemas import names
from schemas.jobs import Error
from schemas.job_status import JobQuery, JobReply
from services import bus
from tests.conftest import wait_for
from tests.test_review2_session_attempts import _state, a_session, saved_then_stepped

pytestmark = pytest.mark.timeout(600)
os.environ.setdefault("TINKER_TELEMETRY", "0")


async def test_a_sample_resuming_a_pause_then_a_node_lost_is_not_told_as_a_loss(nc, stack, tiny_model, agents):
    async with a_session(nc, tiny_model, agents) as held:
        steps = held.steps
        job = await saved_then_stepped(nc, steps)
        path = await asyncio.to_thread(lambda: steps.tc.save_weights_for_sampler("s2").result().path)
        sampling = await asyncio.to_thread(lambda: steps.sc.create_sampling_client(model_path=path).result())
        api = names.jobs_api("acme")
        assert isinstance(await bus.request(nc, api.pause, JobQuery(job), JobReply | Error), JobReply)
        await wait_for(lambda: _state(nc, job, "paused", 1), timeout=120, what="the session paused, its state saved")

        def sample():
            prompt = steps.types.ModelInput.from_ints([1, 2, 3])
            params = steps.types.SamplingParams(max_tokens=2, temperature=1.0, seed=1)
            return sampling.sample(prompt, 1, params).result()

        assert (await asyncio.to_thread(sample)).sequences  # the gateway resumes it for the sample: attempt 2
        assert (await _state(nc, job, "running", 2)) is not None
        agents.kill("box")  # before any training call reached attempt 2: it changed nothing, lost nothing
        agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
        await wait_for(lambda: _state(nc, job, "running", 3), timeout=120, what="attempt 3 running")
        assert await asyncio.to_thread(steps.step) == 3.0  # found: 'went away ... load_state it'
