"""Listeners of one subject on one connection share one subscription (services/fanout.py): the scheduler and the
registry in `jetlora scheduler`'s process hear each heartbeat through it, so the server sends it once. Each hears
every message, a listener that raises stops no other, and the subscription ends with its last listener. Real NATS."""

from __future__ import annotations

import nats

from services import fanout
from tests.conftest import wait_for

SUBJECT = "jetlora.node.*.heartbeat"


def _subscriptions(nc, subject: str) -> int:
    """The connection's subscriptions of `subject` (each one the server delivers a message to)."""
    return sum(1 for sub in nc._subs.values() if sub.subject == subject)


async def test_listeners_share_one_subscription_and_each_hears_every_message(nats_server, nc):
    sender = await nats.connect(nats_server.url)
    heard: dict[str, list[bytes]] = {"a": [], "b": []}

    async def a(msg) -> None:
        heard["a"].append(msg.data)
        raise RuntimeError("a's fault is its own")

    async def b(msg) -> None:
        heard["b"].append(msg.data)

    first = await fanout.listen(nc, SUBJECT, a)
    second = await fanout.listen(nc, SUBJECT, b)
    assert _subscriptions(nc, SUBJECT) == 1
    await nc.flush()
    for i in range(3):
        await sender.publish(f"jetlora.node.n{i}.heartbeat", b"%d" % i)
    await wait_for(lambda: len(heard["b"]) == 3, timeout=5, what="b hearing all three")
    assert heard == {"a": [b"0", b"1", b"2"], "b": [b"0", b"1", b"2"]}

    await first.unsubscribe()
    await sender.publish("jetlora.node.n3.heartbeat", b"3")
    await wait_for(lambda: len(heard["b"]) == 4, timeout=5, what="b hearing on alone")
    assert heard["a"] == [b"0", b"1", b"2"] and _subscriptions(nc, SUBJECT) == 1

    await second.unsubscribe()
    assert _subscriptions(nc, SUBJECT) == 0
    third = await fanout.listen(nc, SUBJECT, b)  # a listener after the last left subscribes anew
    await nc.flush()
    await sender.publish("jetlora.node.n4.heartbeat", b"4")
    await wait_for(lambda: len(heard["b"]) == 5, timeout=5, what="b hearing through a new subscription")
    await third.unsubscribe()
    await sender.close()
