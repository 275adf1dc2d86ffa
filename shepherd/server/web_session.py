"""The web view's login: a session cookie that names an API token, and the anti-forgery
value every form carries.

A person logs in with a token (``/login``); the cookie then says which token, until
when, and a MAC over both and the token's stored hash under a key all server
processes share (kept in the BMDB, ``bmdb.ensure_server_key``: a login on one
process holds on every other). Invariants, each enforced here:

* **The token itself is never in the cookie**, nor in any page: a cookie that leaks
  (a proxy's log) names a token and expires; it does not hand the token out.
* **Revoked or expired means logged out, on the next request**: every request looks
  the token up by name among the live ones (``bmdb.token_named``), and the MAC covers
  its stored hash, so a new token made under the same name does not inherit the
  sessions of the one revoked.
* **No form is taken from another site**: each carries ``csrf``, a MAC of the session
  cookie under the same key, which another site can neither read nor make; the
  cookie is ``SameSite=Strict`` besides, so a browser does not even send it with a
  cross-site post. A post without both is refused and changes nothing.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import os
from dataclasses import dataclass

import bmdb
from shepherd.operations import tokens
from shepherd.roles import Role

COOKIE = "shepherd_session"
#: How long a login lasts.
LIFETIME = dt.timedelta(hours=12)
KEY_NAME = "web-session"


@dataclass(frozen=True)
class SessionKey:
    secret: bytes

    @classmethod
    def from_bmdb(cls, db: bmdb.BMDB) -> SessionKey:
        return cls(db.read(lambda tx: bmdb.ensure_server_key(tx, KEY_NAME, os.urandom(32))))

    def _mac(self, *parts: str) -> str:
        digest = hmac.new(self.secret, "\n".join(parts).encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def cookie(self, name: str, token_hash: str, until: dt.datetime) -> str:
        """The cookie's value for a login of token ``name`` until ``until``."""
        stamp = str(int(until.timestamp()))
        return f"{name}.{stamp}.{self._mac('session', name, stamp, token_hash)}"

    def csrf(self, cookie: str) -> str:
        """The anti-forgery value of the forms of the session ``cookie``."""
        return self._mac("csrf", cookie)

    def forms_allowed(self, cookie: str | None, given: str | None) -> bool:
        """Whether a post carries the csrf value of its own session cookie."""
        return bool(cookie and given) and hmac.compare_digest(self.csrf(str(cookie)),
                                                              str(given))

    def caller(self, tx: bmdb.Tx, cookie: str | None) -> tokens.Caller | None:
        """Who the cookie is logged in as, or None (no cookie, a forged, expired or
        revoked one)."""
        name, _, rest = (cookie or "").partition(".")
        stamp, _, mac = rest.partition(".")
        if not (name and stamp.isdigit() and mac):
            return None
        if int(stamp) <= tx.now.timestamp():
            return None
        found = bmdb.token_named(tx, name)
        if found is None:
            return None
        expected = self._mac("session", name, stamp, found[1])
        if not hmac.compare_digest(expected, mac):
            return None
        return tokens.Caller(found[0].name, Role.parse(found[0].role))


def log_in(tx: bmdb.Tx, key: SessionKey, token: str) -> tuple[tokens.Caller, str]:
    """The caller ``token`` is and a cookie for them (``tokens.Unauthenticated`` if it
    is no live token); the login lasts ``LIFETIME`` or until the token expires."""
    caller = tokens.authenticate(tx, token)
    found = bmdb.token_named(tx, caller.name)
    assert found is not None
    until = tx.now + LIFETIME
    if found[0].expires_at is not None:
        until = min(until, found[0].expires_at)
    return caller, key.cookie(caller.name, found[1], until)
