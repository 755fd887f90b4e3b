"""Tenants as state (#62): their quotas live in the tenants bucket, which `jetlora tenants set|rm` (the CLI, as a
process) edits while the scheduler runs; a change takes effect at its next pass, without a restart. The scheduler's
--quota flags seed the bucket at its first start and never write over it later; a bad value is refused naming its
flag and the fix, nothing written; a tenant may not change tenants."""

from __future__ import annotations

import asyncio
import sys

import msgspec

from schemas import names
from schemas.tenants import TenantList, TenantRecord, TenantsQuery, tenant_key
from services import bus
from services.scheduler.config import TenantQuota
from tests.conftest import ROOT, get_job, wait_for, wait_nodes, wait_state
from tests.test_fair_share import start, submit_as
from tests.test_fair_share_shapes import HOLD, under_way


async def jetlora(url: str, *argv: str) -> tuple[int, str]:
    """Run `jetlora ARGV --nats URL` as a process: its exit code and what it printed (both streams)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        *argv,
        "--nats",
        url,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


async def tenants(nc) -> dict[str | None, tuple[float, int, int]]:
    """Each tenant's (weight, fair share, devices in use), as `jetlora tenants` shows them."""
    reply = await bus.request(nc, names.TENANTS, TenantsQuery(), TenantList)
    return {t.tenant: (t.weight, t.fair_share, t.in_use) for t in reply.tenants}


async def stored(nc, tenant: str) -> TenantRecord | None:
    kv = await nc.jetstream().key_value(names.TENANTS_KV)
    try:
        return msgspec.json.decode((await kv.get(tenant_key(tenant))).value or b"", type=TenantRecord)
    except Exception:
        return None


async def test_a_tenants_weight_changed_live_takes_effect_at_the_next_pass(nc, services, agents, nats_server):
    url = nats_server.url
    sched = await start(services, quotas={"acme": TenantQuota(weight=3)})  # seeds the bucket: its first start
    assert await stored(nc, "acme") == TenantRecord(weight=3)
    agents.start("n1", gpus="4096,4096,4096,4096", hold_s=60.0, env=HOLD)
    await wait_nodes(nc, 1)
    acme = [await submit_as(nc, "acme", label=f"acme-{i}") for i in range(4)]
    await under_way(nc, sched, acme)
    globex = [await submit_as(nc, "globex", label=f"globex-{i}") for i in range(2)]
    await wait_state(nc, globex[0], "running", timeout=20)  # weights 3:1: globex's share is 1
    assert await tenants(nc) == {"acme": (3.0, 3, 3), "globex": (1.0, 1, 1)}

    code, out = await jetlora(url, "tenants", "set", "globex", "--weight", "3")
    assert code == 0 and "tenant globex: weight 3.0" in out, out
    await wait_state(nc, globex[1], "running", timeout=20)  # 3:3 now: a second of acme's devices goes to globex
    assert await tenants(nc) == {"acme": (3.0, 2, 2), "globex": (3.0, 2, 2)}
    assert sched.preemption.stats["victims"] == 2

    code, out = await jetlora(url, "tenants", "set", "globex", "--weight", "0", "--borrow", "x")
    assert code == 2 and "--borrow x: give a whole number" in out and "nothing was written" in out, out
    code, out = await jetlora(url, "tenants", "set", "globex", "--weight", "0")
    assert code == 2 and "--weight 0: give a number above 0, at most 1000" in out, out
    code, out = await jetlora(url, "tenants", "set", "globex", "--weight", "2", "--tenant", "globex")
    assert code == 2 and "a tenant cannot set tenants' quotas" in out, out
    assert await stored(nc, "globex") == TenantRecord(weight=3)

    code, out = await jetlora(url, "tenants", "rm", "acme")
    assert code == 0 and "default quota" in out, out
    await wait_for(lambda: sched.cfg.quotas.keys() == {"globex"}, what="the scheduler to follow the removal")
    assert (await tenants(nc))["acme"][0] == 1.0
    code, out = await jetlora(url, "quota")  # the same command; a table of the tenants
    assert code == 0 and "globex" in out and "sharing: fair over 4 devices" in out, out
    for job in acme + globex:  # nothing else changed hands for the edits
        assert (await get_job(nc, job)).state in ("running", "queued")


async def test_the_quota_flags_seed_the_bucket_once(nc, services):
    sched = await start(services, quotas={"acme": TenantQuota(weight=2, devices=1)})
    assert sched.cfg.quotas == {"acme": TenantQuota(weight=2, devices=1)}
    for stop, task, _ in list(services.running):
        await services.stop(stop, task)
    again = await start(services, quotas={"acme": TenantQuota(weight=5), "initech": TenantQuota(weight=7)})
    assert again.cfg.quotas == {"acme": TenantQuota(weight=2, devices=1)}  # what is stored, not the new flags
    assert await stored(nc, "initech") is None
