"""jetlora's services: each talks to the others only over NATS subjects."""

__version__ = "0.1.0"
