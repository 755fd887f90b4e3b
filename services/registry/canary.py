"""Canaries: a promote moves the name on a few of the live nodes serving it first, and the registry finishes
it (every node) or rolls it back by itself, from what those nodes report. A gated canary (schemas/served.py) also
waits for each node's served score of its eval, and rolls back one outside the trainer-side interval.

One clock decides: the registry's. A report counts for a canary only if the bucket stored it after the canary's
nodes were picked (its sequence, `seq`, is above the canary's `after`), never by a time an agent wrote; the deadline
is the registry's wall clock. A report counts for the node its key names (node.<name>.<node>: the registry's view
leaves out one whose payload names another)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator

import msgspec

from schemas.parity import describe as describe_parity
from schemas.registry import AdapterReply, Alias, Canary, NodeAdapterStatus
from schemas.served import bounds, counts, trainer_side, within
from services.controller import Controller
from services.registry.store import AdapterRegistry, RegistryError

log = logging.getLogger(__name__)
CHECK_S = 0.5
BAD = ("failed", "mismatch")


def pick(reply: AdapterReply, spec: str, version: int, deadline_s: float, live, after: int) -> Canary:
    """The canary nodes: the first `spec` (N, or N%) of the live nodes (`live(node)`) that serve the name now, by
    name; `after`: the bucket's sequence before the registry read `reply`."""
    alias = reply.alias
    verified = sorted({n.node for n in reply.nodes if n.version == alias.current and n.state == "loaded"})
    if not verified:
        raise RegistryError(
            f"no node serves {alias.name} verified yet (`loaded`), so there is nothing to try "
            f"{alias.name}@{version} beside: promote it without --canary"
        )
    serving = [node for node in verified if live(node)]
    if not serving:
        raise RegistryError(
            f"no node that serves {alias.name} verified is live (the registry hears no heartbeats from "
            f"{', '.join(verified)}): promote it without --canary, or when they are back"
        )
    count = math.ceil(len(serving) * int(spec[:-1]) / 100) if spec.endswith("%") else int(spec)
    if count >= len(serving):
        raise RegistryError(
            f"a canary of {count} of the {len(serving)} nodes serving {alias.name} is all of them: "
            "ask for fewer, or promote without --canary"
        )
    now = time.time()
    return Canary(version=version, nodes=serving[: max(1, count)], deadline=now + deadline_s, started=now, after=after)


def outcome(alias: Alias, nodes: list[NodeAdapterStatus], now: float) -> tuple[bool, str] | None:
    """(passed, why) once the canary is decided; None while it is not."""
    canary = alias.canary
    assert canary is not None
    on = {
        n.node: n
        for n in nodes  # what each canary node said of this version, stored since the canary began
        if n.node in canary.nodes and n.version == canary.version and n.seq > canary.after
    }
    for node in canary.nodes:
        if (why := _rolled_back(alias, canary, node, on.get(node))) is not None:
            return False, why
    if all(_verified(canary, on.get(node)) for node in canary.nodes):
        served = ""
        if (e := canary.eval) is not None:
            scores = ", ".join(f"{n} {s.mean:.3f}" for n in canary.nodes if (s := on[n].served) is not None)
            served = f" (served eval {e.eval}: {scores}, within {trainer_side(e)})"
        return True, (
            f"canary of {alias.name}@{canary.version} passed on {', '.join(canary.nodes)} in "
            f"{now - canary.started:.1f}s{served}; promoted on every node"
        )
    if now > canary.deadline:
        waiting = ", ".join(_waiting(n, on.get(n)) for n in canary.nodes if not _verified(canary, on.get(n)))
        return False, (
            f"canary of {alias.name}@{canary.version} rolled back: not verified within "
            f"{canary.deadline - canary.started:.0f}s ({waiting})"
        )
    return None


def _verified(canary: Canary, n: NodeAdapterStatus | None) -> bool:
    """The node loaded the version, verified; on a gated canary, with its served score of the canary's eval."""
    return n is not None and n.state == "loaded" and (canary.eval is None or counts(canary.eval, n.served))


def _waiting(node: str, n: NodeAdapterStatus | None) -> str:
    if n is None:
        return f"{node} silent"
    return f"{node} {n.state}" + (", no served score yet" if n.state == "loaded" else "")


def _rolled_back(alias: Alias, canary: Canary, node: str, n: NodeAdapterStatus | None) -> str | None:
    """Why this node's report rolls the canary back (None: it does not): a failed load, a mismatch (its probe, or
    parity beyond bounds: the figures are in its message), and on a gated canary a served score outside the
    trainer-side interval."""
    if n is None:
        return None
    head = f"canary of {alias.name}@{canary.version} rolled back: node {node}"
    if n.state in BAD:
        return f"{head} reported {n.state}: {n.message}"
    e = canary.eval
    if e is None or n.state != "loaded":
        return None
    parity = "parity not measured" if n.parity is None else describe_parity(n.parity)
    if n.parity is not None and n.parity.within is False:
        return f"{head}: its engine's log-probabilities are beyond bounds: {parity}"
    s = n.served
    if s is None or not counts(e, s) or within(e, s):
        return None
    low, high = bounds(e)
    per_grader = ", ".join(
        f"{g} {m:.3f}" + (f" (trainer {e.graders[g]:.3f})" if g in e.graders else "") for g, m in s.graders.items()
    )
    return (
        f"{head} served eval {e.eval} at {s.mean:.3f} over {s.items} items, outside the trainer-side "
        f"{e.mean:.3f} [{e.low:.3f}, {e.high:.3f}] widened by {e.tolerance:g} to [{low:.3f}, {high:.3f}]; "
        f"per grader {per_grader}; {s.agree} of {s.items} answered as the trainer; {parity}"
        + (f"; e.g. {s.example}" if s.example else "")
    )


def finished(alias: Alias, passed: bool, why: str) -> Alias:
    canary = alias.canary
    assert canary is not None
    if not passed:
        return msgspec.structs.replace(alias, canary=None, last_rollout=why)
    history = alias.history + [alias.current] if alias.current is not None else alias.history
    return msgspec.structs.replace(alias, current=canary.version, history=history, canary=None, last_rollout=why)


def decided(replies: dict[str, AdapterReply]) -> Iterator[tuple[Alias, bool, str]]:
    """Each canary under way that its nodes' reports decide now: (its alias, passed, why)."""
    for reply in replies.values():
        alias = reply.alias
        if alias.canary is not None and (outcome_now := outcome(alias, reply.nodes, time.time())) is not None:
            yield alias, *outcome_now


def controller(registry: AdapterRegistry) -> Controller[dict[str, AdapterReply]]:
    """Decide every canary under way as its nodes report, every CHECK_S; a change made meanwhile (compare-and-set)
    wins."""

    async def decide(work: tuple[Alias, bool, str]) -> None:
        alias, passed, why = work
        try:
            await registry.change_alias(alias.name, lambda a: finished(a, passed, why), None, alias.changes)
            (log.info if passed else log.warning)("%s", why)
        except RegistryError as e:  # it changed meanwhile (a promote, a rollback): that change decides
            log.info("canary of %s: %s", alias.name, e)

    return Controller("canaries", CHECK_S, decided, decide)
