"""age (age-encryption.org/v1) encryption of an export's files to X25519 recipients, as save_weights_external's
`age_encryption_recipients` asks and the cookbook's weights.download decrypts (pyrage): a random file key wrapped for
each recipient (an X25519 share, HKDF-SHA256, ChaCha20-Poly1305), the header's HMAC, then the file in 64 KiB chunks
of ChaCha20-Poly1305 under a key derived from the file key and a random nonce (the STREAM construction, the last
chunk flagged). Encryption only: the gateway never holds an identity."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Iterator

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

CHUNK = 64 * 1024
MAX_RECIPIENTS = 16
SUFFIX = ".age"
_BECH32 = "qpzry9x8gf2tvdw0s3jn54khce6mua7l"


def recipients(value: object) -> list[str]:
    """The recipients a request names (age1... X25519 public keys), checked; a ValueError naming what is wrong."""
    if not isinstance(value, list) or not value or len(value) > MAX_RECIPIENTS:
        raise ValueError(f"give a list of 1 to {MAX_RECIPIENTS} age X25519 recipients (age1...)")
    for r in value:
        if not isinstance(r, str):
            raise ValueError("each recipient is a string, age1...")
        public_key(r)
    return list(value)


def public_key(recipient: str) -> bytes:
    """The 32 bytes of an age1... recipient (bech32, BIP 173, without its 90-character limit)."""
    text = recipient.strip().lower()
    hrp, sep, data = text.rpartition("1")
    if hrp != "age" or not sep or len(data) < 7 or any(c not in _BECH32 for c in data):
        raise ValueError(f"{recipient[:80]!r} is not an age X25519 recipient (age1...)")
    values = [_BECH32.index(c) for c in data]
    if _polymod([ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp] + values) != 1:
        raise ValueError(f"{recipient[:80]!r}: its checksum does not hold")
    acc, bits, out = 0, 0, bytearray()
    for v in values[:-6]:
        acc, bits = (acc << 5) | v, bits + 5
        if bits >= 8:
            bits -= 8
            out.append((acc >> bits) & 0xFF)
    if len(out) != 32 or bits >= 5 or acc & ((1 << bits) - 1):
        raise ValueError(f"{recipient[:80]!r} is not a 32-byte X25519 key")
    return bytes(out)


def _polymod(values: list[int]) -> int:
    gen, chk = (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3), 1
    for v in values:
        top, chk = chk >> 25, (chk & 0x1FFFFFF) << 5 ^ v
        for i in range(5):
            chk ^= gen[i] if (top >> i) & 1 else 0
    return chk


def _hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode().rstrip("=")


def _stanza(file_key: bytes, recipient: bytes) -> str:
    ephemeral = X25519PrivateKey.generate()
    share = ephemeral.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(recipient))
    wrap = _hkdf(shared, share + recipient, b"age-encryption.org/v1/X25519")
    body = _b64(ChaCha20Poly1305(wrap).encrypt(bytes(12), file_key, None))
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    if len(body) % 64 == 0:
        lines.append("")  # a body's last line is shorter than 64 columns
    return f"-> X25519 {_b64(share)}\n" + "\n".join(lines) + "\n"


def encrypt(recipients_: list[str], chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The age file of the plaintext `chunks` yields (any sizes), piece by piece: the header, then each sealed
    64 KiB chunk as soon as the one after it is known (the last is flagged)."""
    file_key = os.urandom(16)
    header = "age-encryption.org/v1\n" + "".join(_stanza(file_key, public_key(r)) for r in recipients_) + "---"
    mac = hmac.new(_hkdf(file_key, b"", b"header"), header.encode(), hashlib.sha256).digest()
    nonce = os.urandom(16)
    yield f"{header} {_b64(mac)}\n".encode() + nonce
    aead, counter, pending = ChaCha20Poly1305(_hkdf(file_key, nonce, b"payload")), 0, b""
    for piece in chunks:
        pending += piece
        while len(pending) > CHUNK:  # more comes after this chunk: not the last
            yield aead.encrypt(counter.to_bytes(11, "big") + b"\x00", pending[:CHUNK], None)
            counter, pending = counter + 1, pending[CHUNK:]
    yield aead.encrypt(counter.to_bytes(11, "big") + b"\x01", pending, None)
