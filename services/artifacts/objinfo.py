"""How an artifact's description rides on its object-store entry: `Jetlora-*` headers, read back as ArtifactInfo."""

from __future__ import annotations

from schemas.artifacts import ArtifactInfo, ArtifactMeta

HEADER = "Jetlora-"


def artifact_headers(job: str, kind: str, meta: ArtifactMeta) -> dict[str, list[str]]:
    return {HEADER + k: [v] for k, v in (("Job", job), ("Kind", kind), ("Base-Model", meta.base_model),
                                         ("Trainer-Version", meta.trainer_version), ("Summary", meta.summary),
                                         ("Filename", meta.filename), ("Tenant", meta.tenant)) if v}


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
    return ArtifactInfo(name=obj.name, job=get("Job"), kind=get("Kind"), size=obj.size or 0, sha256=get("Sha256"),
                        created=obj.mtime or "", base_model=get("Base-Model"), trainer_version=get("Trainer-Version"),
                        summary=get("Summary"), filename=get("Filename"), tenant=get("Tenant"))
