"""The API-key rule shared by ``hyla serve`` and ``hyla route``: ``Authorization: Bearer <key>``.

The scheme's case does not matter (RFC 7235); the token is compared in constant time. Torch-free, so
the router (which imports no engine) checks keys by the same rule as the workers behind it.
"""

from __future__ import annotations

import secrets

API_KEY_MESSAGE = "missing or invalid API key (send 'Authorization: Bearer <key>')"


def bearer_key_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header's value carries ``key`` as a bearer token."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())
