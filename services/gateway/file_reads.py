"""A tenant's file read by the gateway for what it needs of it, and no more: its first rows (to resolve a grader's
`{{item.x}}` templates at the door), or all its rows where a run takes them, refused by the row count the upload
recorded before a byte is fetched. Every refusal names the request's field."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import msgspec
from nats.js.errors import NotFoundError

from schemas import names, nats_subjects
from schemas.dataset_check import UTF8_BOM
from schemas.datasets import DatasetInfo
from services.gateway.errors import bad_request

FILE_MAX = 64 * 2**20  # a file whose rows a run reads whole
HEAD_BYTES = 8 * 2**20  # read for a file's first rows at most (its rows are up to 2 MiB each)
_decode_row = msgspec.json.Decoder().decode


async def first_rows(nc, info: DatasetInfo, count: int) -> list[Any]:
    """Up to `count` of the file's first rows, decoded, read from the start of the stored object only."""
    js = nc.jetstream()
    store = nats_subjects.objects(names.DATASETS_BUCKET)
    try:
        obj = await (await js.object_store(names.DATASETS_BUCKET)).get_info(names.dataset_object(info.name, info.owner))
    except NotFoundError:
        return []
    data, seq, whole = b"", 0, True
    rows: list[Any] = []
    for k in range(obj.chunks or 0):
        try:
            msg = await js.get_msg(store.stream, seq=seq + 1, subject=store.chunks(obj.nuid), next=True, direct=True)
        except NotFoundError:
            break
        seq, data = msg.seq, data + msg.data
        if (data.count(b"\n") >= count or len(data) > HEAD_BYTES) and k < (obj.chunks or 0) - 1:
            whole = False
            break
    lines = data.removeprefix(UTF8_BOM).split(b"\n")
    complete = lines if whole else lines[:-1]  # the last line read may go on in the chunks not read
    for line in complete:
        if line.strip() and len(rows) < count:
            try:
                rows.append(_decode_row(line))
            except msgspec.DecodeError:
                break  # checked at upload: only a row cut by HEAD_BYTES can fail
    return rows


async def all_rows(nc, info: DatasetInfo, most: int, field: str) -> list[Any]:
    """Every row of the file, each decoded; refused naming `field` when it holds more than `most` rows or
    FILE_MAX bytes, which the upload's own count says before anything is read."""
    from services.transfer.download import fetch_object

    if info.stats.rows > most:
        raise bad_request(
            f"{field}: {info.name} has {info.stats.rows:,} rows; a run takes up to {most:,}: split it across runs",
            field,
        )
    if info.size > FILE_MAX:
        raise bad_request(f"{field}: {info.name} is {info.size:,} bytes; a run's file is up to {FILE_MAX:,}", field)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        stored = names.dataset_object(info.name, info.owner)
        await fetch_object(nc.jetstream(), names.DATASETS_BUCKET, stored, path, info.sha256)
        lines = path.read_bytes().removeprefix(UTF8_BOM).splitlines()
    rows: list[Any] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if len(rows) == most:
            raise bad_request(f"{field}: {info.name} has more than {most:,} rows; a run takes up to {most:,}", field)
        try:
            rows.append(_decode_row(line))
        except msgspec.DecodeError as e:
            raise bad_request(f"{field}: line {n} of {info.name} is not JSON ({e})", field) from None
    return rows
