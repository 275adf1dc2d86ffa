"""The operators' API tokens: roles, how a token is made, and how a request's token
becomes the operator who asked (``Caller``).

Invariants, each enforced here:

* **A token is shown once and stored never**: ``create`` returns it to its caller
  (``shepherd token create`` prints it) and hands the BMDB only its SHA-256
  (``token_hash``). A token is 256 random bits, so its hash cannot be reversed by
  trying, and no salt or slow hash is needed.
* **Compared in constant time**: the BMDB finds the row by the hash (an index
  lookup whose timing says nothing about the token: an attacker cannot steer a
  hash's bytes), and ``authenticate`` compares the stored hash with
  ``hmac.compare_digest`` besides.
* **Refused on the next request once revoked or expired**: ``authenticate`` asks
  the BMDB each time (``bmdb.token_by_hash`` reads live rows only), nothing is
  cached.
* **Never in text we write**: ``Token`` records carry no token; a ``Caller`` carries
  the token's name; refusals say what is wrong, never what was sent.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta

import bmdb
from shepherd.operations.arguments import BadArgument
from shepherd.roles import Role

#: What every token starts with: says what it is when one is found in a file or a
#: paste (secret scanners match on it).
PREFIX = "shepherd_"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_DURATION = re.compile(r"([1-9][0-9]{0,4})([dhm])")
_UNIT = {"d": timedelta(days=1), "h": timedelta(hours=1), "m": timedelta(minutes=1)}


class Unauthenticated(Exception):
    """No token, or one that is not a live token (HTTP 401); the text says which."""


class Forbidden(Exception):
    """A live token whose role may not do this (HTTP 403); the text says what it needs."""


@dataclass(frozen=True)
class Caller:
    """Who asked: the token's name (what history records) and its role."""

    name: str
    role: Role

    def require(self, role: Role, what: str) -> None:
        if self.role < role:
            raise Forbidden(f"{what} needs the {role.word} role; token {self.name!r} "
                            f"is {self.role.word}")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_name(text: str) -> str:
    if not NAME.fullmatch(text):
        raise BadArgument(f"{text!r} is not a token name (1-64 letters, digits and ._@-, "
                          "starting with a letter or digit)")
    return text


def parse_expiry(text: str) -> timedelta:
    """``90d``, ``12h`` or ``30m``."""
    found = _DURATION.fullmatch(text.strip())
    if not found:
        raise BadArgument(f"{text!r} is not a lifetime (like 90d, 12h or 30m)")
    return int(found.group(1)) * _UNIT[found.group(2)]


def create(session: bmdb.Session, name: str, role: Role, expires: timedelta | None,
           by: str) -> tuple[str, bmdb.Token]:
    """A new token and its record; the token is not kept anywhere (see the module)."""
    token = PREFIX + secrets.token_urlsafe(32)
    try:
        record = session.transact(lambda tx: bmdb.create_token(
            tx, parse_name(name), role.word, token_hash(token),
            tx.now + expires if expires else None, by))
    except bmdb.TokenExists as error:
        raise BadArgument(str(error)) from None
    return token, record


def authenticate(tx: bmdb.Tx, token: str | None) -> Caller:
    """The caller a request's token names; ``Unauthenticated`` if it names none."""
    if not token:
        raise Unauthenticated("no token: send Authorization: Bearer TOKEN")
    wanted = token_hash(token)
    found = bmdb.token_by_hash(tx, wanted)
    if found is None or not hmac.compare_digest(found[1], wanted):
        raise Unauthenticated("token not accepted: unknown, revoked or expired")
    return Caller(found[0].name, Role.parse(found[0].role))


def parse_role(text: str) -> Role:
    try:
        return Role.parse(text)
    except ValueError as error:
        raise BadArgument(str(error)) from None
