"""Input no JSON reader keeps (nested 100,000 deep, a number like 1e999) is a rejection naming the request, not a
fault of the service; a command given a name that cannot be a subject token says so in a line and exits 2."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import nats.errors

from schemas import names
from schemas.jobs import Error, Rejected, SubmitReply
from schemas.job_status import JobReply
from tests.conftest import ROOT, retrying

DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE = b'{"model": "tiny", "base_dir": "/m", "data": [{"q": "a", "a": "b"}], "train": {"learning_rate": 1e999}}'


async def asked(nc, subject: str, payload: bytes):
    """The reply, asked again while nothing answers yet (a scheduler that has just taken the lead)."""
    return await retrying(lambda: nc.request(subject, payload, timeout=10), nats.errors.NoRespondersError)


async def test_deep_nesting_and_numbers_out_of_range_are_rejections(nc, stack):
    for payload in (DEEP, HUGE, b'{"model": ' + DEEP + b"}"):
        reply = msgspec.json.decode((await asked(nc, names.SUBMIT, payload)).data, type=SubmitReply)
        assert isinstance(reply, Rejected), reply
        assert "the service failed" not in reply.errors[0].reason, reply
    for payload in (DEEP, b'{"job": ' + DEEP + b"}"):
        reply = msgspec.json.decode((await asked(nc, names.GET_JOB, payload)).data, type=JobReply | Error)
        assert isinstance(reply, Error) and "the service failed" not in reply.error, reply


def test_permissions_for_names_that_cannot_be_tokens_exit_2_in_one_line():
    for flags in (["--tenants", "a.b"], ["--tenants", ">"], ["--tenants", "upload"], ["--nodes", "n*"]):
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "permissions", *flags], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr, done
        assert done.stderr.count("\n") == 1
