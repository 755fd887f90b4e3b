"""What the operator sets for the Tinker API (`jetlora gateway` and `jetlora up` flags), and the bounds on what one
tenant may hold: each refused with a 400 that names the bound and what to do."""

from __future__ import annotations

from dataclasses import dataclass

HEARTBEAT_S = 10.0  # the `tinker` client heartbeats each session this often


@dataclass(frozen=True)
class TinkerSettings:
    idle_s: float = 900.0  # a training session with no call this long is checkpointed and its device freed
    silence_s: float = 3 * HEARTBEAT_S  # a session whose client sent no heartbeat this long is paused the same way
    end_s: float = 600.0  # a session silent this long is finished (its running jobs stop and store their adapters)
    retention_s: float = 86400.0  # a finished session's records are deleted this long after it finished
    max_sessions: int = 16  # sessions per tenant, from create_session until finished (tinker/bounds.py)
    max_models: int = 32  # training models and base samplers per tenant, in its sessions not finished
    max_sampler_saves: int = 64  # named sampler saves per tenant (in the object store), until deleted or expired
    max_pending: int = 256  # calls per tenant that a gateway runs and that are not done yet
    seq_window: int = 32  # a seq_id at most this far ahead of the model's next
    gap_s: float = 30.0  # a missing seq_id waited for this long; then it fails and the calls after it run

    def problems(self) -> list[str]:
        """What is out of range, as the flags name it."""
        out = []
        if not 10 <= self.idle_s <= 7 * 86400:
            out.append(f"--tinker-idle-s {self.idle_s:g}: give 10 to 604800 seconds")
        if not 2 * HEARTBEAT_S <= self.silence_s <= 86400:
            out.append(
                f"--tinker-silence-s {self.silence_s:g}: give {2 * HEARTBEAT_S:g} to 86400 seconds (the client "
                f"heartbeats every {HEARTBEAT_S:g} s)"
            )
        if not 0 <= self.retention_s <= 365 * 86400:
            out.append(f"--tinker-retention-s {self.retention_s:g}: give 0 to 31536000 seconds")
        return out


def limit(count: int, bound: int, what: str, flag: str, fix: str) -> str | None:
    """A refusal's text when `count` reached `bound`."""
    if count < bound:
        return None
    return f"{what}: {count} already, the most a tenant may hold ({bound}, the gateway's {flag}); {fix}"
