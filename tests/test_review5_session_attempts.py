"""Review of 350e119, 890ae0f, 774eee4 and ebc2254 (#63): a Tinker session's client is told "your calls were lost,
load_state" exactly when calls that changed the session were lost. A loss told falsely makes the client throw
away the steps a pause kept; one kept silent lets it train on from a state it never saw. Real stack: nats-server,
the scheduler, an agent as a process with the real session trainer, a gateway, the official client."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.conftest import wait_for
from tests.test_review2_session_attempts import _paused_and_resumed_elsewhere, _state, a_session, saved_then_stepped

pytestmark = pytest.mark.timeout(900)
os.environ.setdefault("TINKER_TELEMETRY", "0")
BOX = dict(gpus=None, offer_cpu=True, trainer=None, interval=0.25)


async def test_a_call_refused_on_a_resumed_attempt_then_its_node_lost_is_no_loss(nc, stack, tiny_model, agents):
    """The session paused and resumed (attempt 2, from the pause's checkpoint at step 2). The client's next
    forward_backward is refused by the session (a token outside the vocabulary: a 400, nothing changed), then the
    node dies before any other call. Attempt 3 goes on from the pause's checkpoint with every step kept: the next
    step is step 3, untold (890ae0f: an answer that refused the call made attempt 2 the one trained on, and its
    loss was told: 'load_state it', which throws away step 2)."""
    async with a_session(nc, tiny_model, agents) as held:
        steps = held.steps
        job = await saved_then_stepped(nc, steps)
        await _paused_and_resumed_elsewhere(nc, job)

        def refused() -> None:
            bad = steps.types.Datum(
                model_input=steps.types.ModelInput.from_ints([1, 2, 10**6]),
                loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
            )
            steps.tc.forward_backward([bad], "cross_entropy").result()

        with pytest.raises(Exception, match="outside the vocabulary"):  # answered by attempt 2, which changed nothing
            await asyncio.to_thread(refused)
        agents.kill("box")
        agents.start("box", **BOX)
        await wait_for(lambda: _state(nc, job, "running", 3), timeout=120, what="attempt 3 running")
        assert await asyncio.to_thread(steps.step) == 3.0  # found: 'went away ... load_state it'
