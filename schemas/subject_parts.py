"""What a jetlora subject names, read back from it: the tenant, node, job or uploader that its tokens carry (each
checked where a request could carry what it should not). The subjects are spelled in schemas/names.py."""

from __future__ import annotations

from schemas.names import ADMIN_TENANT, RESERVED_TENANTS, check_token


def _checked_tenant_token(token: str, subject: str) -> str:
    """A tenant token taken from a request's subject: one token, and none of jetlora's own."""
    if token in RESERVED_TENANTS:
        raise ValueError(
            f"tenant {token!r} in {subject} is reserved ({', '.join(sorted(RESERVED_TENANTS))} are jetlora's own "
            "tokens): a tenant asks on its own subjects, an admin on those without a tenant token"
        )
    return check_token(token, "tenant")


def tenant_of_subject(subject: str) -> str | None:
    """The tenant in a jetlora.<group>.<tenant>.<verb> request subject (api, artifacts, datasets); None for
    jetlora.<group>.<verb> (an admin's). A reserved token (`_`, `upload`) or one that is no tenant raises
    ValueError: it must never reach what an admin's verb, or jetlora's own subjects, would."""
    parts = subject.split(".")
    return _checked_tenant_token(parts[2], subject) if len(parts) == 4 else None


def asker_of_subject(subject: str) -> str:
    """Whose request a jetlora.<group>[.<tenant>].<verb> subject is, unchecked (the token as sent; ADMIN_TENANT
    for an admin's): what a service shares its turns by, before the request is read."""
    parts = subject.split(".")
    return parts[2] if len(parts) == 4 else ADMIN_TENANT


def uploader_of_subject(subject: str) -> str:
    """The node in a jetlora.artifacts.upload.<node>.<job> subject."""
    return subject.split(".")[3]


def tenant_of_dataset_upload(subject: str) -> str | None:
    """The tenant of a jetlora.datasets.<tenant>.upload.<name> subject, checked as tenant_of_subject checks it;
    None for an admin's jetlora.datasets.upload.<name>."""
    parts = subject.split(".")
    return _checked_tenant_token(parts[2], subject) if len(parts) == 5 else None


def node_of_subject(subject: str) -> str:
    """The node id in a jetlora.node.<node>.* subject."""
    return subject.split(".")[2]


def job_and_node_of_subject(subject: str) -> tuple[str, str]:
    """The job and node ids in a jetlora.job.<tenant>.<job>.<node>.* subject."""
    parts = subject.split(".")
    return parts[3], parts[4]


def tenant_of_event_subject(subject: str) -> str | None:
    """The job's tenant in a jetlora.job.<tenant>.<job>.<node>.* subject; None for an admin's job."""
    token = subject.split(".")[2]
    return None if token == ADMIN_TENANT else token
