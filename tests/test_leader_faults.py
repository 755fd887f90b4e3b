"""Two schedulers, an artifact service and an agent as real processes, each behind its own proxy; submissions every
0.25 s while the leading scheduler is frozen (SIGSTOP) or cut off (its connection blackholed) for twice the lease.
Afterwards: every accepted job and every stored job ended exactly once, no terminal state replaced, no device held
twice, no trainer beside another of its job (tests/harness/invariants.py)."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from schemas import names
from schemas.jobs import Accepted
from services import bus
from tests.conftest import answering, submit
from tests.harness import Stack
from tests.harness.invariants import StatusWatch, trainer_overlaps, unfinished
from tests.qa import pairs

FAULT_S = 6.0  # twice the lease's TTL: a standby takes over meanwhile


@pytest.mark.parametrize("fault", ["frozen", "cut off"])
async def test_a_leader_frozen_or_cut_off_under_steady_submissions_loses_and_orphans_nothing(tmp_path, fault):
    log = tmp_path / "steps"
    async with Stack(tmp_path) as stack:
        stack.start_scheduler("a")
        nc = await nats.connect(stack.client_url)
        try:
            await answering(nc, names.LIST_JOBS)  # a leads
            stack.start_scheduler("b")
            stack.start_artifacts("artifacts")
            stack.start_agent("n1", gpus="4096,4096,4096,4096", hold_s=0.6, env={"HOLD_LOG": str(log)})
            watch = await StatusWatch(nc.jetstream()).start()
            accepted: set[str] = set()

            async def submitting(seconds: float) -> None:
                end, i = time.monotonic() + seconds, 0
                while time.monotonic() < end:
                    i += 1
                    body = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "label": f"s{i}"}
                    try:
                        reply = await asyncio.wait_for(submit(nc, body), 3.0)
                        if isinstance(reply, Accepted):
                            accepted.add(reply.job)
                    except (bus.RequestError, TimeoutError):
                        pass  # a client retries; this one counts only what was accepted
                    await asyncio.sleep(0.25)

            load = asyncio.create_task(submitting(4 + FAULT_S + 3))
            await asyncio.sleep(2.0)  # the fault comes in the middle of the submissions
            if fault == "frozen":
                await stack.stall_for("a", FAULT_S)
            else:
                stack.blackhole("a", FAULT_S)
            await load
            assert len(accepted) >= 10, f"only {len(accepted)} submissions were accepted"
            left = await unfinished(nc, accepted, timeout=90)
            await watch.stop()
            problems = left + watch.violations + trainer_overlaps(log, bound_s=2.0)
            assert not problems, (problems, stack.log("a")[-3000:], stack.log("b")[-3000:])
            assert "scheduler leading" in stack.log("b"), "the standby never took over: the fault was too short"
            print(f"{fault}: {len(accepted)} accepted, {watch.writes} status writes, all ended once")
        finally:
            await nc.close()
