"""The job index: jobs in submission order and in finishing order, so that listing and retention read a page of
what they need instead of every job ever."""

from __future__ import annotations

import json

import msgspec
from nats.js.errors import NotFoundError

from schemas import names, nats_subjects
from services.jetstream_writer import JetStreamWriter, ViaJsPublish

STREAM = names.JOB_INDEX_STREAM
NO_RESULTS = {"404", "408", "413"}  # none found; a timeout; more than one answer may carry


class Finished(msgspec.Struct, kw_only=True):
    """An entry in finishing order: which job, when it ended, and where its submission entry is."""

    job: str
    tenant: str | None
    state: str
    finished: float
    submitted_seq: int = 0


class Entry(msgspec.Struct):
    seq: int
    subject: str
    data: bytes


_enc = msgspec.json.Encoder()
_finished = msgspec.json.Decoder(Finished)


def decode_finished(data: bytes) -> Finished:
    return _finished.decode(data)


class JobIndex:
    """Appends to the index stream and walks it newest first (each step one direct get, no consumer)."""

    def __init__(self, nc, writer: JetStreamWriter | None = None) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.writer: JetStreamWriter | ViaJsPublish = writer or ViaJsPublish(self.js)

    async def submitted(self, tenant: str | None, job: str, once: bool = False) -> int:
        """Enter a new job; its entry's sequence is its place in listings. `once`: the job's id may be entered again
        (a retry of a submission under the id its first try reserved): within the stream's duplicate window the
        server keeps the first entry and answers its sequence."""
        headers = {"Nats-Msg-Id": f"submitted-{job}"} if once else None
        ack = await self.writer.publish(
            names.job_index_submitted(names.tenant_token(tenant)), job.encode(), headers, 5.0
        )
        return ack.seq

    async def finished(self, entry: Finished) -> int:
        ack = await self.writer.publish(
            names.job_index_finished(names.tenant_token(entry.tenant), entry.state),
            _enc.encode(entry),
            {"Nats-Msg-Id": f"done-{entry.job}"},
            5.0,
        )
        return ack.seq

    async def end(self) -> int:
        """One past the index's newest entry: where a walk back from the newest starts."""
        return (await self.js.stream_info(STREAM)).state.last_seq + 1

    async def before(self, subject: str, seq: int) -> Entry | None:
        """The newest entry on `subject` (wildcards allowed) with a sequence below `seq`, which must not be past
        end() (the server finds nothing at all for a sequence it has not reached)."""
        if seq <= 1:
            return None
        found = await self._last_per_subject(subject, seq - 1)
        return max(found, key=lambda e: e.seq) if found else None

    async def newest_before(self, subject: str, before: int, count: int) -> list[Entry]:
        """Up to `count` entries on `subject` below sequence `before`, newest first, read in windows of the stream
        that double until enough are found: a page costs a few requests, not one per entry."""
        found: list[Entry] = []
        hi, window, cap = before, max(2 * count, 64), max(4 * count, 256)
        while len(found) < count and hi > 1:
            lo = max(1, hi - window)
            raw = await self._direct({"seq": lo, "next_by_subj": subject, "batch": cap})
            if len(raw) == cap and raw[-1].seq < hi - 1 and window > 1:  # more in the window than one answer
                window //= 4  # carries: narrow it (the newest are wanted, the answer holds the oldest)
                continue
            found += sorted((e for e in raw if e.seq < hi), key=lambda e: e.seq, reverse=True)
            hi, window = lo, window * 2
        return found[:count]

    async def oldest(self, subject: str, after: int = 0) -> Entry | None:
        """The oldest entry on `subject` after sequence `after`."""
        try:
            msg = await self.js.get_msg(STREAM, seq=after + 1, subject=subject, next=True)
        except NotFoundError:
            return None
        return Entry(msg.seq, msg.subject, msg.data or b"")

    async def remove(self, seq: int) -> None:
        try:
            await self.js.delete_msg(STREAM, seq)
        except NotFoundError:
            pass  # already gone

    async def _last_per_subject(self, subject: str, up_to_seq: int) -> list[Entry]:
        """The newest message of each subject that matches, up to a sequence; a wildcard over tenants answers
        one message per tenant."""
        return await self._direct({"multi_last": [subject], "up_to_seq": up_to_seq})

    async def _direct(self, request: dict, timeout: float = 5.0) -> list[Entry]:
        """JetStream's batched direct get (nats-py has no call for it): every message the request matches."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            body = json.dumps(request).encode()
            await self.nc.publish(nats_subjects.js_api("DIRECT", "GET", STREAM), body, reply=inbox)
            out: list[Entry] = []
            while True:
                msg = await sub.next_msg(timeout=timeout)
                headers = msg.headers or {}
                status = headers.get("Status")
                if status == "204":  # end of the batch
                    return out
                if status in NO_RESULTS:
                    if status == "413":
                        raise RuntimeError(f"the job index answered 413 to {request}: too many results for one lookup")
                    return out
                out.append(Entry(int(headers["Nats-Sequence"]), headers["Nats-Subject"], msg.data))
        finally:
            await sub.unsubscribe()
