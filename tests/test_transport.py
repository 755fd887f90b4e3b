"""A whole job over TLS with client certificates, and with nkey users: the right credential works, none is refused."""

from __future__ import annotations

import asyncio
import os

import nats
import nkeys
import pytest
import trustme

from schemas.jobs import Accepted
from services import bus
from services.artifacts.service import ArtifactService
from services import connection
from services.connection import BusOptions
from services.embedded import EmbeddedNats
from services.scheduler.service import Scheduler, SchedulerConfig
from tests.conftest import Agents, submit, wait_state
from tests.qa import pairs


async def run_a_job(url: str, opts: dict, agent_flags: tuple[str, ...], tmp_path) -> None:
    """Scheduler and artifact service in-process, an agent as a process, each with its own credential."""
    conns = [await connection.connect(BusOptions(url=url, **opts), service=False) for _ in range(3)]
    nc, stop = conns[0], asyncio.Event()
    await bus.ensure_resources(nc)
    sched = Scheduler(conns[1], SchedulerConfig(co_train="off", heartbeat_interval=0.25))
    tasks = [asyncio.create_task(sched.run(stop)), asyncio.create_task(ArtifactService(conns[2]).run(stop))]
    agents = Agents(url, tmp_path)
    try:
        await asyncio.wait_for(sched.leading.wait(), 10)
        agents.start("n1", gpus="4096", interval=0.25, hold_s=0.3, bus_flags=agent_flags)
        reply = await submit(nc, {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2)})
        assert isinstance(reply, Accepted), reply
        job = await wait_state(nc, reply.job, ("succeeded", "failed"), timeout=60)
        assert job.state == "succeeded", (job.message, agents.log("n1")[-2000:])
        assert [a.kind for a in job.artifacts] == ["peft"]
    finally:
        agents.close()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            await c.close()


async def refused(url: str, **kwargs) -> bool:
    try:
        nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=1, connect_timeout=3, **kwargs)
    except Exception:
        return True
    await nc.close()
    return False


async def test_a_whole_job_over_tls_with_client_certificates(tmp_path):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    server_cert.private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    client_cert = ca.issue_cert("jetlora-services")
    client_cert.cert_chain_pems[0].write_to_path(tmp_path / "client.pem")
    client_cert.private_key_pem.write_to_path(tmp_path / "client.key")
    tls = (
        f'tls {{ cert_file: "{tmp_path / "server.pem"}", key_file: "{tmp_path / "server.pem"}", '
        f'ca_file: "{tmp_path / "ca.pem"}", verify: true, timeout: 5 }}\n'
    )
    server = EmbeddedNats(store_dir=tmp_path / "nats", websocket=False, extra_config=tls).start()
    try:
        files = dict(
            tls_ca=str(tmp_path / "ca.pem"), tls_cert=str(tmp_path / "client.pem"), tls_key=str(tmp_path / "client.key")
        )
        without_cert = BusOptions(url=server.url, tls_ca=files["tls_ca"]).tls_context()
        assert await refused(server.url, tls=without_cert), "a client without a certificate got in"
        assert await refused(server.url), "a plain-text client got in"
        await run_a_job(
            server.url,
            files,
            ("--tls-ca", files["tls_ca"], "--tls-cert", files["tls_cert"], "--tls-key", files["tls_key"]),
            tmp_path,
        )
    finally:
        server.stop()


def nkey_user(tmp_path, name: str) -> tuple[str, str]:
    """A new nkey user: (its seed file, its public key)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = tmp_path / f"{name}.nk"
    path.write_bytes(seed)
    return str(path), nkeys.from_seed(seed).public_key.decode()


async def test_a_whole_job_with_nkey_users(tmp_path):
    services_seed, services_key = nkey_user(tmp_path, "services")
    agent_seed, agent_key = nkey_user(tmp_path, "agent")
    stranger_seed, _ = nkey_user(tmp_path, "stranger")
    auth = f"authorization {{ users = [ {{ nkey: {services_key} }}, {{ nkey: {agent_key} }} ] }}\n"
    server = EmbeddedNats(store_dir=tmp_path / "nats", websocket=False, extra_config=auth).start()
    try:
        assert await refused(server.url), "a client without an nkey got in"
        assert await refused(server.url, nkeys_seed=stranger_seed), "an unknown nkey got in"
        await run_a_job(server.url, dict(nkey=services_seed), ("--nkey", agent_seed), tmp_path)
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _no_env_credentials(monkeypatch):
    for var in ("NATS_URL", "NATS_CREDS", "NATS_NKEY", "NATS_CA", "NATS_CERT", "NATS_KEY"):
        monkeypatch.delenv(var, raising=False)
