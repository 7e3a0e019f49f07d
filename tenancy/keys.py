"""API key material, no database: the shape of a key, generation, peppered HMAC hashing,
constant-time verification, and the pepper (a setting, or a file made once in the data dir).

Key rows (creation, revocation, quotas, the bootstrap admin key) are `tenancy.api_keys`."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import string
import time
from pathlib import Path

from lockgate.tenancy.errors import Invalid

KEY_PREFIX = "lg-"
LOOKUP_PREFIX_LEN = 12          # characters after "lg-" stored in clear for the lookup
PEPPER_FILE = "pepper"
PEPPER_BYTES = 32
MIN_PEPPER_BYTES = 16

_HEX = frozenset(string.hexdigits)
# A presented key: "lg-", then at least a lookup prefix and some secret, no whitespace.
_KEY_RE = re.compile(rf"^lg-[\x21-\x7e]{{{LOOKUP_PREFIX_LEN + 8},253}}$")


def well_formed(plaintext: object) -> bool:
    """Whether `plaintext` has the shape of a key: "lg-", 20 to 253 printable non-space
    characters."""
    return isinstance(plaintext, str) and _KEY_RE.match(plaintext) is not None


def generate_key() -> tuple[str, str]:
    """A new key: (plaintext "lg-..." shown once, its lookup prefix)."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    return plaintext, lookup_prefix(plaintext)


def lookup_prefix(plaintext: str) -> str:
    """The stored lookup prefix of a key: the first 12 characters after "lg-"."""
    return plaintext[len(KEY_PREFIX):len(KEY_PREFIX) + LOOKUP_PREFIX_LEN]


def hash_secret(plaintext: str, pepper: bytes) -> str:
    """HMAC-SHA256 of the whole plaintext key under the pepper, as hex."""
    if not pepper:
        raise Invalid("pepper", "must not be empty")
    return hmac.new(pepper, plaintext.encode("utf-8"), hashlib.sha256).hexdigest()


def verify(plaintext: str, stored_hash: str, pepper: bytes) -> bool:
    """Whether `plaintext` hashes to `stored_hash` (constant-time comparison)."""
    return hmac.compare_digest(hash_secret(plaintext, pepper), stored_hash)


def _decode_pepper(text: str, source: str) -> bytes:
    value = text.strip()
    if not value:
        raise Invalid("pepper", f"{source} is empty")
    if len(value) % 2 == 0 and set(value) <= _HEX:
        raw = bytes.fromhex(value)
        if len(raw) < MIN_PEPPER_BYTES:
            raise Invalid("pepper", f"{source}: at least {MIN_PEPPER_BYTES} bytes "
                                    f"({2 * MIN_PEPPER_BYTES} hex digits) needed, got {len(raw)}")
        return raw
    raw = value.encode("utf-8")
    if len(raw) < 2 * MIN_PEPPER_BYTES:
        raise Invalid("pepper", f"{source}: give {2 * MIN_PEPPER_BYTES}+ hex digits or a "
                                f"string of at least {2 * MIN_PEPPER_BYTES} bytes")
    return raw


def pepper_from_setting(value: str) -> bytes:
    """The pepper from a setting: hex (>= 16 bytes) is decoded, else a >= 32-byte string."""
    if not isinstance(value, str):
        raise Invalid("pepper", f"must be a string, got {type(value).__name__}")
    return _decode_pepper(value, "the pepper setting")


def load_or_create_pepper(data_dir: Path) -> bytes:
    """Read `data_dir/pepper`, creating it (32 random bytes as hex, mode 0600) the first time.

    Creation uses O_CREAT|O_EXCL, so concurrent starters agree on one pepper."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / PEPPER_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, (secrets.token_hex(PEPPER_BYTES) + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
    # Another process may have just created the file and not written it yet.
    deadline = time.monotonic() + 2.0
    while True:
        text = path.read_text(encoding="ascii")
        if text.strip() or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return _decode_pepper(text, f"the pepper file {str(path)!r}")
