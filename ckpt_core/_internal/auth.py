"""Peer authentication at rendezvous: an HMAC challenge over the rendezvous store.

When workers share a token (engine option ``auth_token``, or the environment variable
``CKPT_CORE_AUTH_TOKEN``), the store's host (policy rank 0) publishes a random challenge;
every other worker answers with HMAC-SHA256(token, challenge | identity); the host checks
each answer and replies with its own HMAC, so both sides prove they hold the token and the
token itself never crosses the wire. A worker with a wrong or missing token is refused with
an ``AuthenticationError`` on both sides, before any process group is formed.

Without a token anywhere the exchange still runs (answers say "no token"), so a worker that
has a token meeting one that does not is a clear error rather than a silent downgrade.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Any

from ckpt_core.errors import AuthenticationError

AUTH_TOKEN_ENV = "CKPT_CORE_AUTH_TOKEN"
_NO_TOKEN = "no-token"


def resolve_token(option: str | None) -> bytes | None:
    """The token from the option, else from ``CKPT_CORE_AUTH_TOKEN``, else ``None``."""
    token = option if option is not None else os.environ.get(AUTH_TOKEN_ENV) or None
    return token.encode() if token is not None else None


def _mac(token: bytes, *parts: str) -> str:
    return hmac.new(token, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def _get(store: Any, key: str) -> str:
    return bytes(store.get(key)).decode("ascii", errors="replace")


def host_challenge(store: Any, token: bytes | None) -> None:
    """Publish the challenge (the store's host does this before anyone can answer)."""
    store.set("auth/challenge", secrets.token_hex(32))


def verify_members(store: Any, token: bytes | None, members: list[str]) -> None:
    """Host side: check each member's answer and reply; raises naming every refused member."""
    challenge = _get(store, "auth/challenge")
    refused = []
    for identity in members:
        answer = _get(store, f"auth/answer/{identity}")
        expected = _mac(token, challenge, identity) if token is not None else _NO_TOKEN
        if hmac.compare_digest(answer, expected):
            verdict = _mac(token, challenge, identity, "accepted") if token is not None else _NO_TOKEN
        else:
            verdict = "refused"
            refused.append(f"{identity} ({_why(answer, token)})")
        store.set(f"auth/verdict/{identity}", verdict)
    outcome = f"refused at rendezvous: {', '.join(refused)}" if refused else "ok"
    store.set("auth/outcome", outcome)  # accepted members wait for it, so none forms a group alone
    if refused:
        raise AuthenticationError(f"{outcome}; give every worker the same auth_token (or {AUTH_TOKEN_ENV})")


def _why(answer: str, token: bytes | None) -> str:
    if token is None:
        return "it has a token, this host has none"
    if answer == _NO_TOKEN:
        return "it has no token"
    return "wrong token"


def answer_challenge(store: Any, token: bytes | None, identity: str, host: str) -> None:
    """Member side: answer the host's challenge and check the host's reply."""
    challenge = _get(store, "auth/challenge")
    store.set(f"auth/answer/{identity}", _mac(token, challenge, identity) if token is not None else _NO_TOKEN)
    verdict = _get(store, f"auth/verdict/{identity}")
    if verdict == "refused":
        raise AuthenticationError(
            f"{host} refused this worker ({identity}) at rendezvous: its auth_token differs; give "
            f"every worker the same auth_token (or {AUTH_TOKEN_ENV})"
        )
    expected = _mac(token, challenge, identity, "accepted") if token is not None else _NO_TOKEN
    if not hmac.compare_digest(verdict, expected):
        raise AuthenticationError(
            f"{host} could not prove it holds this worker's auth_token ({identity}); refusing to "
            f"connect. Give every worker the same auth_token (or {AUTH_TOKEN_ENV})"
        )
    outcome = _get(store, "auth/outcome")
    if outcome != "ok":
        raise AuthenticationError(
            f"{host} {outcome}; this worker ({identity}) was accepted, but the refit group cannot form"
        )
