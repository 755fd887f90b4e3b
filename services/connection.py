"""How a service or the CLI reaches NATS: the flags (URL, credentials, TLS) and the connection made from them."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from schemas import nats_subjects

log = logging.getLogger(__name__)
PING_INTERVAL_S = 5  # a service's connection pings the server this often (nats-py's default is 120 s) ...
MAX_OUTSTANDING_PINGS = 3  # ... and, with this many unanswered, takes it for stale and reconnects: a connection
# whose reading stopped (the server or a link silent, or nats-py's read loop ended) is replaced within ~20 s, not ~4 min
ROUND_TRIP_KEPT_S = 60  # how long a round trip's PONG is waited for in the background after its caller gave up: past
# the stale window above, so the connection is replaced (its PONGs forgotten) before nats-py would cancel the wait


@dataclass
class BusOptions:
    """How to reach NATS: what `--nats`, `--creds` and the TLS flags say."""

    url: str | None = None
    creds: str | None = None
    nkey: str | None = None  # a file holding an nkey seed
    user: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    replicas: int = 1
    name: str = "jetlora"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, repeated: bool = False) -> None:
        """repeated: on a sub-command of a parser that has them already (they may come after it, too)."""
        g = parser.add_argument_group("NATS")
        if repeated:
            add = g.add_argument

            def g_add(*a, **kw):
                kw["default"] = argparse.SUPPRESS
                return add(*a, **kw)

            g.add_argument = g_add  # type: ignore[method-assign]  # every flag of this group defaults to unset
        g.add_argument(
            "--nats",
            dest="nats_url",
            default=os.environ.get("NATS_URL"),
            help="server URL, or several comma-separated for a cluster (env NATS_URL); "
            "none: start an embedded nats-server",
        )
        g.add_argument("--creds", default=os.environ.get("NATS_CREDS"), help="credentials file (env NATS_CREDS)")
        g.add_argument(
            "--nkey",
            default=os.environ.get("NATS_NKEY"),
            help="file holding this user's nkey seed (env NATS_NKEY); the server lists its public key",
        )
        g.add_argument("--user", default=os.environ.get("NATS_USER"))
        g.add_argument(
            "--password-file",
            default=os.environ.get("NATS_PASSWORD_FILE"),
            help="file holding the password (env NATS_PASSWORD_FILE); passwords never go on the command line",
        )
        g.add_argument("--tls-ca", default=os.environ.get("NATS_CA"))
        g.add_argument("--tls-cert", default=os.environ.get("NATS_CERT"))
        g.add_argument("--tls-key", default=os.environ.get("NATS_KEY"))
        g.add_argument(
            "--replicas",
            type=int,
            default=int(os.environ.get("JETLORA_REPLICAS", "1")),
            help="replicas of jetlora's streams and buckets (3 on a 3-server cluster)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, name: str) -> "BusOptions":
        password = None
        if args.password_file:
            with open(args.password_file) as f:
                password = f.read().strip()
        return cls(
            url=args.nats_url,
            creds=args.creds,
            nkey=args.nkey,
            user=args.user,
            password=password,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            replicas=args.replicas,
            name=name,
        )

    def tls_context(self) -> ssl.SSLContext | None:
        if not (self.tls_ca or self.tls_cert):
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx


def redacted(url: str | None) -> str:
    """The server URL(s) as a log may show them: a password in one is replaced by ***."""
    shown = []
    for one in (url or "").split(","):
        parts = urllib.parse.urlsplit(one.strip())
        if parts.password is not None:
            host = parts.netloc.rpartition("@")[2]
            parts = parts._replace(netloc=f"{parts.username}:***@{host}")
        shown.append(parts.geturl())
    return ",".join(shown)


async def round_trip(nc: Client, timeout: float) -> None:
    """Return once the server has everything this connection sent before (a PING answered by its PONG), or raise
    nats.errors.FlushTimeoutError after `timeout`. Not nc.flush(timeout): on its timeout nats-py 2.16 cancels the
    PONG's future but leaves it queued, and the PONG arriving later raises InvalidStateError in the read loop, which
    ends: the connection goes on sending (heartbeats) but hears nothing (assignments, replies) until it is found
    stale. Here the flush itself waits ROUND_TRIP_KEPT_S in the background, so a late PONG resolves a live future."""
    flush = asyncio.ensure_future(nc.flush(timeout=ROUND_TRIP_KEPT_S))
    try:
        await asyncio.wait_for(asyncio.shield(flush), timeout)
    except asyncio.TimeoutError:
        flush.add_done_callback(lambda f: f.cancelled() or f.exception())  # its end is nobody's concern now
        raise nats.errors.FlushTimeoutError from None


async def _quiet(_error) -> None:
    pass


async def connect(opts: BusOptions, service: bool = True) -> Client:
    """A service reconnects forever and logs connection changes; a command-line client fails fast."""

    async def on_error(e):
        log.warning("NATS error: %s", e)

    async def on_disconnect():
        log.warning("disconnected from NATS %s; reconnecting", redacted(opts.url))

    async def on_reconnect():
        log.info("reconnected to NATS")

    url = opts.url or ""
    kwargs: dict[str, Any] = dict(
        servers=[u.strip() for u in url.split(",") if u.strip()],
        name=opts.name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        connect_timeout=5,
        ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
    )
    if not service:
        kwargs.update(allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=1)  # 0 means forever in nats-py
        kwargs["error_cb"] = _quiet  # the caller reports a failed connect in its own words
        kwargs.pop("disconnected_cb")
    if opts.creds:
        kwargs["user_credentials"] = opts.creds
    if opts.nkey:
        kwargs["nkeys_seed"] = opts.nkey
    if opts.user:
        kwargs["user"], kwargs["password"] = opts.user, opts.password
        kwargs["inbox_prefix"] = nats_subjects.inbox(opts.user)  # the only replies its permissions let it read
    if (tls := opts.tls_context()) is not None:
        kwargs["tls"] = tls
    return await nats.connect(**kwargs)
