"""A forward_backward's loss as the gateway checks it before it takes a turn on the node: a loss the trainer serves
(schemas.sessions.LOSSES; `custom` is the client's to run), its loss_fn_config keys and values, and for
stable_reinforce the recorded inputs its datums' provenance names (provenance.py)."""

from __future__ import annotations

import math

from schemas.sessions import LOSS_CONFIG, LOSSES, ForwardBackward
from services.gateway.tinker import proto, provenance
from services.gateway.tinker.futures import Book
from services.gateway.tinker.http import TinkerRefusal

CUSTOM = (
    "loss_fn 'custom' runs a loss uploaded with create_custom_loss on the server, and this server takes no uploads "
    "(client/config says custom_loss_server_side false): the client runs such a loss itself, so pass the function "
    "(or the LossHandle create_custom_loss gave) to forward_backward_custom"
)


def call(message) -> ForwardBackward:
    """The session call of a ForwardBackwardRequest, or a 400 naming what to change."""
    loss = message.loss_fn
    if loss == "custom":
        raise TinkerRefusal(400, CUSTOM)
    if loss not in LOSSES:
        raise TinkerRefusal(400, f"loss_fn {loss[:40]!r} is not served; use one of {', '.join(LOSSES)}")
    try:
        fb = proto.call_of(message)
    except proto.ProtoRefused as e:
        raise TinkerRefusal(400, f"{e} ({e.field})") from None
    check_config(loss, fb.config)
    provenance.check_inputs(fb)
    return fb


def check_config(loss: str, config: dict[str, float]) -> None:
    allowed = LOSS_CONFIG[loss]
    for key in config:
        if key not in allowed:
            keys = ", ".join(allowed) if allowed else "none"
            raise TinkerRefusal(400, f"loss_fn_config[{key[:40]!r}] is not a setting of {loss} (its keys: {keys})")
    low = config.get("clip_low_threshold", allowed.get("clip_low_threshold", 0.0))
    high = config.get("clip_high_threshold", allowed.get("clip_high_threshold", math.inf))
    if "clip_low_threshold" in allowed and not 0 <= low <= 1 <= high:
        raise TinkerRefusal(400, f"loss_fn_config: {loss} clips the ratio to [clip_low_threshold, "
                                 f"clip_high_threshold]; give 0 <= low <= 1 <= high (got {low}, {high})")  # fmt: skip
    if high < 1:
        raise TinkerRefusal(400, f"loss_fn_config.clip_high_threshold {high}: give 1 or more")
    for key in ("beta", "kl_coeff"):
        if config.get(key, 0.0) < 0:
            raise TinkerRefusal(400, f"loss_fn_config.{key} {config[key]}: give 0 or more")


async def complete(book: Book, tenant: str, fb: ForwardBackward, message) -> None:
    """stable_reinforce's recorded inputs, filled in `fb` (other losses need none)."""
    if fb.loss_fn != "stable_reinforce":
        return
    try:
        spans = proto.provenance(message)
    except proto.ProtoRefused as e:
        raise TinkerRefusal(400, f"{e} ({e.field})") from None
    await provenance.fill(book, tenant, fb, spans)
