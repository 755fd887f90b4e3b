"""Ctrl-C on `jetlora up` while a job trains: the terminal's SIGINT goes to the whole foreground process group,
yet `up` stops in order within its shutdown timeout, its nats-server last, and the job goes on at the next `up`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import nats

from schemas.jobs import Accepted
from tests.conftest import HOLD_TRAINER, Agents, states_of, submit, wait_for, wait_state
from tests.qa import pairs
from tests.test_recovery import _jetlora, _nats_servers_under, _until_gone


async def _up(state, hold_s: float) -> tuple[subprocess.Popen, str]:
    """`jetlora up` as a terminal runs it: the leader of its own process group; returns it and its NATS URL."""
    proc = _jetlora(
        "up",
        "--port",
        "0",
        "--offer-cpu",
        "--node",
        "box",
        "--heartbeat-interval",
        "0.25",
        "--trainer-command",
        HOLD_TRAINER,
        "--co-train",
        "off",
        env={"XDG_STATE_HOME": str(state), "HOLD_S": str(hold_s)},
        stdout=subprocess.PIPE,
        stderr=open(state / f"up-{time.monotonic_ns()}.log", "w"),
        start_new_session=True,
    )
    url, line, deadline = "", "", time.monotonic() + 60
    while "dashboard:" not in line and time.monotonic() < deadline:
        line = await asyncio.to_thread(proc.stdout.readline)
        if line.startswith("NATS at "):
            url = line.split()[2]
    assert url and "dashboard:" in line, "jetlora up did not come up"
    return proc, url


async def test_ctrl_c_on_up_mid_job_exits_in_order_and_the_job_goes_on_next_time(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    proc, url = await _up(state, hold_s=120)
    nc = await nats.connect(url)
    try:
        reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), "accelerator": "cpu"})
        assert isinstance(reply, Accepted), reply
        await wait_state(nc, reply.job, ("running",), timeout=60)
    finally:
        await nc.close()

    server = _nats_servers_under(state)
    assert len(server) == 1 and os.getsid(server[0]) != os.getsid(proc.pid)  # Ctrl-C reaches `up`, not its server
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    code = await asyncio.to_thread(proc.wait, 30)
    took = time.monotonic() - t0
    print(f"jetlora up ended {took:.1f}s after SIGINT to its group, exit {code}")
    assert code == 0 and took < 20, (code, took)
    await _until_gone(state)  # its nats-server too, and not left a zombie

    proc, url = await _up(state, hold_s=0.5)  # the next `up`: the job was handed back, and runs again
    nc = await nats.connect(url)
    try:
        job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=60)
        assert job.state == "succeeded", job.message
        states = await states_of(nc, reply.job)
        assert any(s.state == "queued" and "shut down while the job ran" in s.message for s in states), states
    finally:
        await nc.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    await wait_for(lambda: not _nats_servers_under(state), timeout=15, what="the second nats-server to exit")


async def test_an_agent_whose_nats_is_gone_still_stops_within_its_timeout(tmp_path):
    """SIGTERM to an agent mid-job after its nats-server died: its last publish gives up, it does not retry forever."""
    from services.embedded import EmbeddedNats

    server = EmbeddedNats(store_dir=tmp_path / "nats").start()
    agents = Agents(server.url, tmp_path)
    try:
        nc = await nats.connect(server.url)
        from services import bus
        from tests.conftest import InProcess
        from tests.test_consumers import start_stack

        await bus.ensure_resources(nc)
        services = InProcess(server.url)
        await start_stack(services)
        agent = agents.start("n1", gpus="4096", hold_s=120, extra=("--shutdown-timeout", "8"))
        reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2)})
        await wait_state(nc, reply.job, ("running",), timeout=60)
        await services.close()
        await nc.close()
        server.kill()  # NATS gone first
        t0 = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(agent.wait, 30)
        took = time.monotonic() - t0
        print(f"the agent ended {took:.1f}s after SIGTERM with NATS gone, exit {code}")
        assert code == 0 and took < 12, (code, took, agents.log("n1")[-2000:])
        assert "could not say it was handed back" in agents.log("n1")
    finally:
        agents.close()
        server.stop()


async def test_a_job_cancelled_just_before_its_agent_stops_stays_cancelled(stack, nc, agents):
    """Cancel, then SIGTERM at once: the agent ends the job as cancelled instead of handing it back to the queue
    (where another node would run it again)."""
    from schemas import names
    from schemas.job_status import JobQuery, JobReply
    from services import bus
    from tests.conftest import wait_nodes

    agents.start("n1", gpus="4096", hold_s=30)
    await wait_nodes(nc, 1)
    reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "gpu_mib": 1000})
    assert isinstance(reply, Accepted), reply
    await wait_state(nc, reply.job, "running", timeout=30)
    assert (await bus.request(nc, names.CANCEL, JobQuery(reply.job), JobReply)).job  # the agent took the cancel
    agents.procs["n1"].send_signal(signal.SIGTERM)  # and stops at once, before it has reported the job's end
    await asyncio.to_thread(agents.procs["n1"].wait, 30)
    assert (await wait_state(nc, reply.job, "cancelled", timeout=30)).state == "cancelled"
    assert "queued" not in [s.state for s in await states_of(nc, reply.job)]
