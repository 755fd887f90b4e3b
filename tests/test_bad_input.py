"""Hypothesis-made garbage at every subject: no service crashes or stalls, every request gets an error, nothing is stored."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import names
from schemas.artifacts import ChunkAck
from schemas.artifacts import ArtifactQuery
from schemas.job_checks import check_request
from schemas.jobs import Accepted, JobRequest, Rejected
from schemas.job_status import JobListQuery, JobQuery
from services import bus
from services.embedded import EmbeddedNats
from tests.conftest import ROOT
from tests.qa import pairs

VALID = {"model": "tiny", "base_dir": "/models/tiny", "data": pairs(2), "gpu_mib": 100}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
# a valid job with one field replaced by something of another shape
mutated_jobs = st.builds(
    lambda k, v: {**VALID, k: v}, st.sampled_from(sorted(VALID) + ["train", "lora", "node", "priority"]), json_values
).map(lambda d: msgspec.json.encode(d))
invalid_utf8 = st.binary(min_size=1, max_size=64).map(lambda b: b'{"model": "\xff\xfe' + b + b'", "base_dir": "/m"}')
garbage = st.one_of(
    st.binary(max_size=512),
    json_values.map(msgspec.json.encode),
    mutated_jobs,
    invalid_utf8,
    st.integers(200_000, 2_000_000).map(lambda n: b"[" + b"1," * (n // 2) + b"1]"),
)
REQUESTS = [
    names.SUBMIT,
    names.GET_JOB,
    names.LIST_JOBS,
    names.CANCEL,
    names.STOP,
    names.ARTIFACTS_LIST,
    names.ARTIFACTS_DELETE,
]
PUBLISHED = [
    names.node("fuzz").heartbeat,
    names.job("fuzz", "fuzz", "_").state,
    names.job("fuzz", "fuzz", "_").progress,
]
tried = {"requests": 0, "errors": 0, "valid": 0, "published": 0, "chunks": 0}
accepted: list[str] = []  # mutations that happen to be valid jobs are rightly accepted
QUERY_TYPES = {
    names.SUBMIT: JobRequest,
    names.GET_JOB: JobQuery,
    names.CANCEL: JobQuery,
    names.STOP: JobQuery,
    names.LIST_JOBS: JobListQuery,
    names.ARTIFACTS_LIST: ArtifactQuery,
    names.ARTIFACTS_DELETE: ArtifactQuery,
}


def valid_query(subject: str, payload: bytes) -> bool:
    """Would a correct service serve this payload (rather than refuse it)?"""
    try:
        query = msgspec.json.decode(payload or b"{}" if subject in EMPTY_OK else payload, type=QUERY_TYPES[subject])
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False
    if subject == names.SUBMIT:
        return not check_request(query)
    return subject != names.ARTIFACTS_DELETE or query.job is not None


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    server = EmbeddedNats(store_dir=tmp / "nats").start()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "services.cli", kind, "--nats", server.url],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"{kind}.log", "w"),
        )
        for kind in ("scheduler", "artifacts")
    ]
    loop = asyncio.new_event_loop()
    nc = loop.run_until_complete(nats.connect(server.url))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            loop.run_until_complete(bus.request(nc, names.LIST_JOBS, b"{}", dict, timeout=1))
            loop.run_until_complete(bus.request(nc, names.ARTIFACTS_LIST, b"{}", dict, timeout=1))
            break
        except bus.RequestError:
            time.sleep(0.3)
    yield loop, nc, procs
    loop.run_until_complete(nc.close())
    loop.close()
    for p in procs:
        p.terminate()
        p.wait(10)
    server.stop()


EMPTY_OK = {names.LIST_JOBS, names.ARTIFACTS_LIST, names.ARTIFACTS_DELETE}  # an empty body means "no filter"


def is_error_reply(data: bytes) -> bool:
    return msgspec.json.decode(data).get("type") in ("rejected", "error")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(subject=st.sampled_from(REQUESTS + PUBLISHED), payload=garbage)
def test_garbage_never_crashes_stalls_or_stores(stack, subject, payload):
    loop, nc, procs = stack
    if subject in PUBLISHED:
        loop.run_until_complete(nc.publish(subject, payload))
        tried["published"] += 1
        return
    msg = loop.run_until_complete(nc.request(subject, payload, timeout=5))  # a reply, always, and in time
    tried["requests"] += 1
    if valid_query(subject, payload):  # served: a listing, a job, or an error such as "no job x"
        tried["valid"] += 1
        if subject == names.SUBMIT:
            accepted.append(f"request.{msgspec.json.decode(msg.data, type=Accepted).job}")
        return
    assert is_error_reply(msg.data), (subject, payload[:200], msg.data[:300])
    tried["errors"] += 1


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=garbage)
def test_garbage_chunks_are_refused(stack, payload):
    loop, nc, _ = stack
    msg = loop.run_until_complete(nc.request(names.artifact_upload("fuzz", "fuzz"), payload, timeout=5))
    assert not msgspec.json.decode(msg.data, type=ChunkAck).ok
    tried["chunks"] += 1


def test_after_the_garbage_everything_still_works_and_nothing_was_stored(stack):
    loop, nc, procs = stack
    assert all(p.poll() is None for p in procs), "a service died"
    kv = loop.run_until_complete(nc.jetstream().key_value(names.JOBS_KV))
    try:
        keys = loop.run_until_complete(kv.keys())
    except Exception:  # nats-py raises on an empty bucket
        keys = []
    assert sorted(k for k in keys if k.startswith("request.")) == sorted(accepted), keys
    obs = loop.run_until_complete(nc.jetstream().object_store(names.ARTIFACTS_BUCKET))
    try:
        objects = loop.run_until_complete(obs.list())
    except Exception:
        objects = []
    assert objects == []
    reply = loop.run_until_complete(bus.request(nc, names.SUBMIT, VALID, Accepted | Rejected))
    assert isinstance(reply, Accepted)
    print(f"bad inputs tried: {tried}, valid jobs among them (accepted): {len(accepted)}")
    assert tried["requests"] > 100 and tried["requests"] == tried["errors"] + tried["valid"]
    assert tried["errors"] > 0.8 * tried["requests"]  # the garbage is mostly garbage
