"""Error replies are errors to micro: headers a micro client reads, and counts in $SRV.STATS."""

from __future__ import annotations

import msgspec

from schemas import names, nats_subjects
from schemas.jobs import Error, Rejected
from schemas.job_status import JobQuery


async def stats_of(nc, service: str) -> dict[str, dict]:
    reply = await nc.request(nats_subjects.service_stats(service), b"", timeout=5)
    return {e["name"]: e for e in msgspec.json.decode(reply.data)["endpoints"]}


async def test_rejections_and_errors_carry_micro_headers_and_count_in_stats(nc, stack):
    before = await stats_of(nc, names.SCHEDULER_SERVICE)
    bad = await nc.request(
        names.SUBMIT, msgspec.json.encode({"model": "m", "base_dir": "/m", "gpu_mib": -1}), timeout=5
    )
    rejected = msgspec.json.decode(bad.data, type=Rejected)  # the body is the JSON error, as before
    assert rejected.errors and bad.headers["Nats-Service-Error-Code"] == "400"
    assert any(e.field in bad.headers["Nats-Service-Error"] for e in rejected.errors)

    missing = await nc.request(names.GET_JOB, msgspec.json.encode(JobQuery("nosuchjob")), timeout=5)
    error = msgspec.json.decode(missing.data, type=Error)
    assert error.field == "job" and missing.headers["Nats-Service-Error"].startswith("job: no job nosuchjob")

    ok = await nc.request(names.LIST_JOBS, b"{}", timeout=5)
    assert not (ok.headers or {}).get("Nats-Service-Error")  # an answer is not an error

    after = await stats_of(nc, names.SCHEDULER_SERVICE)
    print({k: (before[k]["num_errors"], after[k]["num_errors"]) for k in ("submit", "job", "jobs")})
    assert after["submit"]["num_errors"] == before["submit"]["num_errors"] + 1
    assert after["job"]["num_errors"] == before["job"]["num_errors"] + 1 and "nosuchjob" in after["job"]["last_error"]
    assert after["jobs"]["num_errors"] == before["jobs"]["num_errors"]
    assert after["jobs"]["num_requests"] == before["jobs"]["num_requests"] + 1
