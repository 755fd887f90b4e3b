"""The NATS wire protocol split into frames as bytes arrive, so a proxy can hold back or rewrite whole frames.

Both directions share one splitter: a frame is a control line ending in CRLF (INFO, CONNECT, PUB, HPUB, MSG, HMSG,
SUB, UNSUB, PING, PONG, +OK, -ERR), and for PUB/HPUB/MSG/HMSG the payload whose size is the line's last argument,
followed by CRLF. Payloads are passed on as slices of what arrived, never byte by byte.
"""

from __future__ import annotations

import json
from typing import Any, Callable

PAYLOAD_OPS = frozenset({b"PUB", b"HPUB", b"MSG", b"HMSG"})

# (op, subject) of a frame with a payload -> None to pass it on now, or any object saying why it is held back
Classify = Callable[[bytes, bytes], Any]
# (op, whole control line of a frame without payload) -> the line to pass on instead
Rewrite = Callable[[bytes, bytes], bytes]


class Splitter:
    """Splits one direction of a NATS connection into frames, incrementally (data arrives in arbitrary chunks).

    `feed` returns the bytes to forward now, in order, and the whole frames that `classify` held back, each with
    what `classify` returned for it. Lines of frames without a payload go through `rewrite`."""

    def __init__(self, classify: Classify | None = None, rewrite: Rewrite | None = None):
        self._classify = classify
        self._rewrite = rewrite
        self._pending = b""  # the start of a control line whose CRLF has not arrived yet
        self._remaining = 0  # payload bytes (with their CRLF) of the current frame still to come
        self._hold: Any = None  # what classify said of the current frame; None: it is being passed on
        self._held: list[bytes] = []  # the pieces so far of the frame being held back

    @property
    def at_boundary(self) -> bool:
        """Whether the bytes forwarded so far end between two frames, where another frame may be put in."""
        return not (self._remaining and self._hold is None)

    def feed(self, data: bytes) -> tuple[bytes, list[tuple[Any, bytes]]]:
        """The bytes to forward now and the frames completed and held back by this chunk."""
        if self._pending:
            data, self._pending = self._pending + data, b""
        out: list[bytes] = []
        held: list[tuple[Any, bytes]] = []
        pos, size = 0, len(data)
        while pos < size:
            if self._remaining:
                take = min(self._remaining, size - pos)
                piece = data if take == size else data[pos : pos + take]
                pos += take
                self._remaining -= take
                self._payload(piece, out, held)
                continue
            end = data.find(b"\r\n", pos)
            if end < 0:
                self._pending = data[pos:]
                break
            self._line(data[pos : end + 2], out, held)
            pos = end + 2
        return b"".join(out), held

    def _payload(self, piece: bytes, out: list[bytes], held: list[tuple[Any, bytes]]) -> None:
        if self._hold is None:
            out.append(piece)
            return
        self._held.append(piece)
        if not self._remaining:
            held.append((self._hold, b"".join(self._held)))
            self._held, self._hold = [], None

    def _line(self, line: bytes, out: list[bytes], held: list[tuple[Any, bytes]]) -> None:
        """A whole control line: the start of a frame with a payload, or a frame by itself."""
        args = line.split()
        op = args[0].upper() if args else b""
        if op in PAYLOAD_OPS and len(args) >= 3:
            try:
                remaining = int(args[-1]) + 2
            except ValueError:  # not ours to judge: the other end answers -ERR
                out.append(line)
                return
            self._remaining = remaining
            self._hold = self._classify(op, args[1]) if self._classify else None
            if self._hold is None:
                out.append(line)
            else:
                self._held = [line]
            return
        out.append(self._rewrite(op, line) if self._rewrite else line)


def strip_connect_urls(op: bytes, line: bytes) -> bytes:
    """An INFO line without `connect_urls` and `ws_connect_urls`, so a client behind a proxy never learns the
    servers' own addresses (and never bypasses the proxy after a reconnect); other lines unchanged."""
    if op != b"INFO":
        return line
    try:
        info = json.loads(line[4:])
    except ValueError:
        return line
    if not isinstance(info, dict) or not ({"connect_urls", "ws_connect_urls"} & info.keys()):
        return line
    info.pop("connect_urls", None)
    info.pop("ws_connect_urls", None)
    return b"INFO " + json.dumps(info, separators=(",", ":")).encode() + b"\r\n"
