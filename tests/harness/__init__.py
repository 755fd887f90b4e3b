"""Fault injection against real processes: a NATS proxy that stalls, cuts and holds writes (`proxy.NatsProxy`), and a
stack of real nats-server and jetlora service processes, each behind its own proxy (`stack.Stack`)."""

from tests.harness.proxy import NatsProxy
from tests.harness.stack import Stack, Stall

__all__ = ["NatsProxy", "Stack", "Stall"]
