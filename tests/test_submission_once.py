"""A submission whose write went unanswered (Unsure) and its retry with the same idempotency key are one job, entered
in the job index once: `jobs` lists it once, and retention has one entry of it to remove."""

from __future__ import annotations

import msgspec
import nats
import pytest

from schemas import names
from schemas.job_records import idempotency_key
from schemas.jobs import Accepted, SubmitReply, Unsure
from schemas.job_status import IdempotencyRecord
from services import bus
from services.scheduler.index import JobIndex
from tests.conftest import answering, list_jobs
from tests.harness import Stack
from tests.qa import pairs


@pytest.mark.timeout(90)
async def test_a_retry_of_an_unsure_submission_writes_no_second_index_entry(tmp_path):
    """The scheduler's writes of job requests are dropped until its first try answers Unsure (its index entry and
    active mark went through); the retry, with the writes flowing again, stores the same job: one index entry."""
    async with Stack(tmp_path) as stack:
        stack.start_scheduler("a")
        nc = await nats.connect(stack.client_url)
        try:
            await answering(nc, names.LIST_JOBS)
            body = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(1), "label": "once", "node": "none"}
            body["idempotency_key"] = "k"
            stack.proxy("a").hold_writes(prefixes=("$KV.jetlora_jobs.request.",), mode="drop")
            first = await bus.request(nc, names.SUBMIT, body, SubmitReply, timeout=30)
            assert isinstance(first, Unsure), first
            stack.proxy("a").release_writes()
            again = await bus.request(nc, names.SUBMIT, body, SubmitReply, timeout=30)
            assert isinstance(again, Accepted) and again.job == first.job, again
            listed = [j.id for j in await list_jobs(nc) if j.label == "once"]
            assert listed == [first.job], f"the job is listed {len(listed)} times"
            index = JobIndex(nc)
            entries = await index.newest_before(names.job_index_submitted("*"), await index.end(), 10)
            assert [e.data.decode() for e in entries] == [first.job], entries
            kv = await nc.jetstream().key_value(names.IDEMPOTENCY_KV)
            record = msgspec.json.decode((await kv.get(idempotency_key("/k"))).value, type=IdempotencyRecord)
            assert (record.job, record.index_seq) == (first.job, entries[0].seq), record  # beyond the stream's window
        finally:
            await nc.close()
