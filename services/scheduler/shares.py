"""Fair shares of the fleet's devices: weighted max-min (water-filling) over each tenant's demand, its nominal
devices guaranteed first. Pure arithmetic on a few numbers per tenant: O(tenants log tenants) per computation.

A tenant's demand is what it holds plus what its waiting jobs ask for; it never gets more than that, nor more than
its cap (nominal + borrow). First every tenant gets its nominal (as far as it wants it; if the operator promised
more nominal devices than the fleet has, the nominal ones are water-filled by weight). What is left is
water-filled by weight over what each still wants: the level rises until the devices run out, a tenant that wants
less than its level keeps only what it wants, and the others share the rest in proportion to their weights.
Shares are whole devices: the fractions left over go, one device each, to the largest fractions (ties: the tenant
holding more now keeps it, so shares do not flip between equal tenants as jobs start and end)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Claim:
    """What one tenant brings to the sharing."""

    weight: float
    nominal: int  # devices guaranteed while it wants them
    cap: int | None  # the most it may hold (nominal + borrow); None: no limit
    demand: int  # devices it holds plus those its waiting jobs ask for
    held: int = 0  # devices it holds now (only to break ties)


def fair_shares(capacity: int, claims: Mapping[K, Claim]) -> dict[K, int]:
    """Each tenant's share of `capacity` devices (whole devices; their sum is at most capacity)."""
    wants = {k: max(0, min(c.demand, c.cap) if c.cap is not None else c.demand) for k, c in claims.items()}
    nominal = {k: min(c.nominal, wants[k]) for k, c in claims.items()}
    guaranteed = water_fill(max(0, capacity), nominal, claims)
    left = max(0, capacity) - sum(guaranteed.values())
    extra = water_fill(left, {k: wants[k] - guaranteed[k] for k in claims}, claims)
    return {k: guaranteed[k] + extra[k] for k in claims}


def water_fill(total: int, caps: Mapping[K, int], claims: Mapping[K, Claim]) -> dict[K, int]:
    """Integer weighted max-min: each k gets min(caps[k], level x weight), the level as high as `total` allows."""
    level = _level(total, caps, claims)
    exact = {k: min(float(cap), level * claims[k].weight) for k, cap in caps.items()}
    out = {k: min(caps[k], math.floor(v + 1e-9)) for k, v in exact.items()}
    spare = min(total, sum(caps.values())) - sum(out.values())
    if spare > 0:
        order = sorted(
            (k for k in caps if out[k] < caps[k]),
            key=lambda k: (-(exact[k] - out[k]), -claims[k].held, -claims[k].weight, str(k)),
        )
        for k in order[:spare]:
            out[k] += 1
    return out


def _level(total: int, caps: Mapping[K, int], claims: Mapping[K, Claim]) -> float:
    """The water level: the devices per unit of weight each tenant not yet satisfied gets."""
    order = sorted((k for k in caps if caps[k] > 0), key=lambda k: caps[k] / claims[k].weight)
    left, weights = float(total), sum(claims[k].weight for k in order)
    for k in order:
        w = claims[k].weight
        if caps[k] > left * w / weights:  # this one (and all after it) is limited by the level, not its cap
            return left / weights
        left -= caps[k]
        weights -= w
    return math.inf  # everyone gets all they want
