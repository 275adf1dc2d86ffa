"""The operators' API tokens: who may ask ``shepherd serve`` for what, by name.

Storage only: what a role allows, how a token is made and how it is compared is
the caller's (``shepherd.operations.tokens``). Invariants enforced here:

* **A token is kept only as its hash** (``token_hash``, a SHA-256 of the token,
  made by the caller): nothing here stores or returns the token itself, and
  ``Token`` has no field that could carry it.
* **One live token per name** (the primary key): ``create`` refuses a name whose
  token is neither revoked nor expired, and replaces one that is, in one statement
  each, so two operators creating one name at once get one token and one
  ``TokenExists``.
* **A revoked or expired token finds nothing**: ``by_hash`` reads only live rows,
  judged by the BMDB's clock (``tx.now``) in the same read, so the request after a
  revocation is refused whichever server process it reaches.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa

from bmdb import _schema as schema
from bmdb._database import Tx
from bmdb.errors import BMDBError


class TokenExists(BMDBError):
    """A live token already has this name (revoke it first)."""


@dataclass(frozen=True)
class Token:
    """A token as the BMDB keeps it, without the token."""

    name: str
    role: str
    created_at: dt.datetime
    created_by: str
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None

    def live(self, now: dt.datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


_t = schema.api_tokens
_COLUMNS = (_t.c.name, _t.c.role, _t.c.created_at, _t.c.created_by, _t.c.expires_at,
            _t.c.revoked_at)


def _live(now: dt.datetime) -> sa.ColumnElement[bool]:
    return sa.and_(_t.c.revoked_at.is_(None),
                   sa.or_(_t.c.expires_at.is_(None), _t.c.expires_at > now))


def create(tx: Tx, name: str, role: str, token_hash: str, expires_at: dt.datetime | None,
           by: str) -> Token:
    """Record a new token; ``TokenExists`` if ``name`` has a live one."""
    values = {"role": role, "token_hash": token_hash, "created_at": tx.now,
              "created_by": by, "expires_at": expires_at, "revoked_at": None}
    replaced = tx.execute(_t.update().where(_t.c.name == name, sa.not_(_live(tx.now)))
                          .values(values)).rowcount
    if not replaced:
        inserted = tx.execute(_t.insert().from_select(
            [_t.c.name, *(_t.c[k] for k in values)],
            sa.select(sa.literal(name), *(sa.literal(v, _t.c[k].type)
                                          for k, v in values.items()))
            .where(~sa.exists().where(_t.c.name == name)))).rowcount
        if not inserted:
            raise TokenExists(f"a token named {name!r} exists; revoke it first "
                              f"(`shepherd token revoke {name}`)")
    return Token(name, role, tx.now, by, expires_at, None)


def revoke(tx: Tx, name: str) -> bool:
    """Revoke the live token ``name``; False if there is none."""
    return bool(tx.execute(_t.update().where(_t.c.name == name, _live(tx.now))
                           .values(revoked_at=tx.now)).rowcount)


def listed(tx: Tx) -> list[Token]:
    """Every token, live or not, by name."""
    return [Token(*row) for row in tx.execute(sa.select(*_COLUMNS).order_by(_t.c.name))]


def by_hash(tx: Tx, token_hash: str) -> tuple[Token, str] | None:
    """The live token with this hash and the hash as stored (for the caller's
    constant-time comparison), or None."""
    row = tx.execute(sa.select(*_COLUMNS, _t.c.token_hash)
                     .where(_t.c.token_hash == token_hash, _live(tx.now))).first()
    return None if row is None else (Token(*row[:-1]), str(row[-1]))


def named(tx: Tx, name: str) -> tuple[Token, str] | None:
    """The live token ``name`` and its hash as stored (a web session names its token:
    ``shepherd.server.web_session``), or None."""
    row = tx.execute(sa.select(*_COLUMNS, _t.c.token_hash)
                     .where(_t.c.name == name, _live(tx.now))).first()
    return None if row is None else (Token(*row[:-1]), str(row[-1]))
