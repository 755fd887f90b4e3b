"""A stored format: how an artifact's (or a dataset's) description rides on its object-store entry, as `Jetlora-*`
headers read back as ArtifactInfo (DatasetInfo), and which dataset a tenant sees under a name. The artifact service
writes them; anyone who reads the buckets reads them through here."""

from __future__ import annotations

import msgspec

from schemas import names
from schemas.artifacts import ArtifactInfo, ArtifactMeta
from schemas.datasets import DatasetInfo, DatasetStats

HEADER = "Jetlora-"


def artifact_headers(job: str, kind: str, meta: ArtifactMeta) -> dict[str, list[str]]:
    return {
        HEADER + k: [v]
        for k, v in (
            ("Job", job),
            ("Kind", kind),
            ("Base-Model", meta.base_model),
            ("Trainer-Version", meta.trainer_version),
            ("Summary", meta.summary),
            ("Filename", meta.filename),
            ("Tenant", meta.tenant),
            ("Step", "" if meta.step is None else str(meta.step)),
        )
        if v
    }


def sha256_header(sha: str) -> tuple[str, list[str]]:
    return HEADER + "Sha256", [sha]


def info_from_object(obj) -> ArtifactInfo | None:
    """An object-store entry as an artifact; None for objects jetlora did not write."""
    h = obj.headers or {}

    def get(key: str) -> str:
        v = h.get(HEADER + key, "")
        return v[0] if isinstance(v, list) and v else (v or "")

    if not get("Job"):
        return None
    return ArtifactInfo(
        name=obj.name,
        job=get("Job"),
        kind=get("Kind"),
        size=obj.size or 0,
        sha256=get("Sha256"),
        created=obj.mtime or "",
        base_model=get("Base-Model"),
        trainer_version=get("Trainer-Version"),
        summary=get("Summary"),
        filename=get("Filename"),
        tenant=get("Tenant"),
        step=int(get("Step")) if get("Step") else None,
    )


_stats = msgspec.json.Decoder(DatasetStats)


def dataset_headers(sha: str, stats: DatasetStats, tenants: list[str], owner: str | None) -> dict[str, list[str]]:
    return {
        HEADER + "Sha256": [sha],
        HEADER + "Dataset": [msgspec.json.encode(stats).decode()],
        HEADER + "Tenants": [",".join(tenants)],
        HEADER + "Owner": [owner or ""],
    }


def dataset_from_object(obj) -> DatasetInfo | None:
    """An object-store entry of the datasets bucket as a dataset; None for objects jetlora did not write."""
    h = obj.headers or {}
    stats, sha = h.get(HEADER + "Dataset"), h.get(HEADER + "Sha256")
    if not stats or not sha or getattr(obj, "deleted", False):
        return None
    owner = (h.get(HEADER + "Owner") or [""])[0] or None
    return DatasetInfo(
        name=obj.name.removeprefix(f"{owner}/") if owner else obj.name,
        sha256=sha[0],
        size=obj.size or 0,
        created=obj.mtime or "",
        owner=owner,
        stats=_stats.decode(stats[0]),
        description=obj.description or "",
        tenants=[t for t in (h.get(HEADER + "Tenants") or [""])[0].split(",") if t],
    )


def dataset_lookups(name: str, tenant: str | None) -> list[str]:
    """The object names under which `tenant` looks for its dataset `name`, in order: its own, then the admins' (an
    admin: the admins' only)."""
    return [names.dataset_object(name)] if tenant is None else [names.dataset_object(name, tenant), name]


def visible_to(found: DatasetInfo | None, tenant: str | None) -> bool:
    """Whether `tenant` may see a dataset found under one of dataset_lookups' names: its own, or an admin's that is
    shared with it (an admin sees the admins'). Another tenant's is not there for it."""
    if found is None:
        return False
    if tenant is not None and found.owner == tenant:
        return True
    return found.owner is None and (tenant is None or tenant in found.tenants)
