"""What one service asks another over NATS instead of reading its modules, and how each copes when the other does
not answer: a dataset delete asks the scheduler which unfinished jobs name the dataset (a page of them, from its
memory); a submission asks the registry about the adapters it names; a succeeded job's registration is asked of the
registry until it answers, and the job's message says how it went."""

from __future__ import annotations

import asyncio
import logging

from schemas import names
from schemas.datasets import DatasetDeleted, DatasetQuery, Pinning, PinningQuery
from schemas.jobs import Accepted, Error, Rejected, SubmitReply
from schemas.job_status import JobQuery
from schemas.registry import AdapterQuery, AdapterReply
from services import bus
from services.transfer.datasets import find_dataset
from services.transfer.sender import upload_dataset
from tests.conftest import STACK_CONFIG, get_job, submit, wait_for, wait_state
from tests.qa import pairs
from tests.test_datasets import chat_rows, write_rows

JOB = {"model": "tiny", "base_dir": "/models/tiny"}


async def without_registry(services):
    """A scheduler and an artifact service, and no adapter registry."""
    from services.artifacts.service import ArtifactService
    from services.scheduler.service import Scheduler

    sched, *_ = await services.start(lambda c: Scheduler(c, STACK_CONFIG))
    artifacts, *_ = await services.start(lambda c: ArtifactService(c))
    await asyncio.wait_for(asyncio.gather(sched.leading.wait(), artifacts.ready.wait()), 10)


async def test_a_dataset_delete_asks_the_scheduler_for_a_page_of_the_unfinished_jobs_naming_it(stack, nc, tmp_path):
    write_rows(tmp_path / "chat.jsonl", chat_rows(10))
    for name in ("brief", "other"):
        await upload_dataset(nc, name, tmp_path / "chat.jsonl")
    named = []
    for held_out in (False, True, False, False, False, False, False):  # one names it as its held-out data
        ref = {"validation_dataset": {"name": "brief"}, "dataset": {"name": "other"}} if held_out else {}
        reply = await submit(nc, {**JOB, "dataset": {"name": "brief"}, **ref})
        assert isinstance(reply, Accepted), reply
        named.append(reply.job)
    assert isinstance(await submit(nc, {**JOB, "dataset": {"name": "other"}}), Accepted)
    await bus.request(nc, names.CANCEL, JobQuery(named[0]), object)  # a finished job names it no longer
    await wait_state(nc, named[0], "cancelled")

    page = await bus.request(nc, names.DATASET_PINNING, PinningQuery(dataset="brief", limit=3), Pinning)
    assert page.count == 6 and [p.job for p in page.jobs] == sorted(named[1:])[:3], page
    assert {p.state for p in page.jobs} == {"queued"}
    refused = await bus.request(nc, names.DATASETS.delete, DatasetQuery(name="brief"), DatasetDeleted | Error)
    assert isinstance(refused, Error) and refused.field == "name", refused
    assert "named by 6 unfinished job(s)" in refused.error and refused.error.count("(queued)") == 5, refused.error
    assert "..." in refused.error and "--force" in refused.error
    tenants = await bus.request(nc, names.DATASET_PINNING, PinningQuery(dataset="acme/brief"), Pinning)
    assert tenants.count == 0 and tenants.jobs == []  # a tenant's dataset of that name is another object


async def test_a_dataset_delete_without_a_scheduler_deletes_nothing_unless_forced(services, nc, tmp_path):
    from services.artifacts.service import ArtifactService

    artifacts, *_ = await services.start(lambda c: ArtifactService(c))
    await asyncio.wait_for(artifacts.ready.wait(), 10)
    write_rows(tmp_path / "chat.jsonl", chat_rows(10))
    await upload_dataset(nc, "brief", tmp_path / "chat.jsonl")
    refused = await bus.request(nc, names.DATASETS.delete, DatasetQuery(name="brief"), DatasetDeleted | Error)
    assert isinstance(refused, Error) and refused.field == "force", refused
    assert "the scheduler did not say which unfinished jobs name it" in refused.error, refused.error
    assert await find_dataset(nc.jetstream(), "brief") is not None
    await bus.request(nc, names.DATASETS.delete, DatasetQuery(name="brief", force=True), DatasetDeleted)
    assert await find_dataset(nc.jetstream(), "brief") is None


async def test_a_submission_that_needs_the_registry_is_refused_naming_the_field_while_it_does_not_answer(services, nc):
    await without_registry(services)
    init = await submit(nc, {**JOB, "data": pairs(2), "init_adapter": {"name": "support"}})
    assert isinstance(init, Rejected) and init.errors[0].field == "init_adapter.name", init
    assert "the adapter registry did not answer" in init.errors[0].reason and "submit again" in init.errors[0].reason
    as_tenant = await bus.request(
        nc, names.jobs_api("acme").submit, {**JOB, "data": pairs(2), "register": {"name": "support"}}, SubmitReply
    )
    assert isinstance(as_tenant, Rejected) and as_tenant.errors[0].field == "register.name", as_tenant
    assert "the adapter registry did not answer" in as_tenant.errors[0].reason
    admin = await submit(nc, {**JOB, "data": pairs(2), "register": {"name": "support"}})
    assert isinstance(admin, Accepted), admin  # an admin's name needs no owner's check: registered when it succeeds


async def test_a_registration_waits_for_the_registry_and_the_job_says_how_it_went(services, nc, agents, caplog):
    from services.registry.service import RegistryService

    caplog.set_level(logging.WARNING, logger="services.scheduler.registry_asks")
    await without_registry(services)
    agents.start("n1", gpus="4096", hold_s=0.2)
    reply = await submit(nc, {**JOB, "data": pairs(2), "register": {"name": "late", "promote": True}})
    assert isinstance(reply, Accepted), reply
    await wait_state(nc, reply.job, "succeeded", timeout=60)
    await wait_for(lambda: "asking again" in caplog.text, what="the scheduler to find no registry")
    registry, *_ = await services.start(lambda c: RegistryService(c))  # it comes up after the job succeeded
    await asyncio.wait_for(registry.ready.wait(), 10)

    async def noted():
        job = await get_job(nc, reply.job)
        return job if "registered as late@1 and promoted" in job.message else None

    await wait_for(noted, timeout=60, what="the job's message to say it was registered")
    late = await bus.request(nc, names.ADAPTERS.show, AdapterQuery(name="late"), AdapterReply)
    assert [(v.version, v.job) for v in late.versions] == [(1, reply.job)] and late.alias.current == 1
