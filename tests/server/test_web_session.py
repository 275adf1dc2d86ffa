"""The web view's session cookie and anti-forgery value, on a real BMDB."""

from __future__ import annotations

import datetime as dt
import functools

import pytest
import sqlalchemy as sa

import bmdb
from shepherd.operations import tokens
from shepherd.roles import Role
from shepherd.server.web_session import SessionKey, log_in


@pytest.fixture
def db(db_url: str):
    handle = bmdb.connect(db_url)
    yield handle
    handle.close()


def test_a_login_names_its_token_until_it_is_revoked_or_made_again(db: bmdb.BMDB) -> None:
    key = SessionKey.from_bmdb(db)
    assert SessionKey.from_bmdb(db) == key  # every process the same key
    with db.start_session("t", interval=5) as session:
        token, _ = tokens.create(session, "alice", Role.OPERATOR, None, "t")
        caller, cookie = db.read(lambda tx: log_in(tx, key, token))
        assert caller == tokens.Caller("alice", Role.OPERATOR)
        assert token not in cookie and token[len(tokens.PREFIX):] not in cookie
        assert db.read(lambda tx: key.caller(tx, cookie)) == caller
        session.transact(lambda tx: bmdb.revoke_token(tx, "alice"))
        assert db.read(lambda tx: key.caller(tx, cookie)) is None
        tokens.create(session, "alice", Role.ADMIN, None, "t")  # the name again
        assert db.read(lambda tx: key.caller(tx, cookie)) is None


def test_a_forged_or_expired_cookie_is_nobody(db: bmdb.BMDB) -> None:
    key = SessionKey.from_bmdb(db)
    with db.start_session("t", interval=5) as session:
        token, _ = tokens.create(session, "bob", Role.VIEWER, dt.timedelta(hours=1), "t")
        _, cookie = db.read(lambda tx: log_in(tx, key, token))
        name, stamp, mac = cookie.split(".")
        later = str(int(stamp) + 86400)
        for forged in (f"{name}.{later}.{mac}", f"admin.{stamp}.{mac}", "", "x", "a.b.c",
                       SessionKey(b"other" * 8).cookie("bob", "0" * 64, dt.datetime.now(
                           dt.UTC) + dt.timedelta(hours=1))):
            assert db.read(functools.partial(key.caller, cookie=forged)) is None, forged
        t = bmdb._schema.api_tokens
        session.transact(lambda tx: tx.execute(sa.update(t).values(
            expires_at=tx.now - dt.timedelta(seconds=1))))
        assert db.read(lambda tx: key.caller(tx, cookie)) is None


def test_forms_need_the_csrf_value_of_their_own_session(db: bmdb.BMDB) -> None:
    key = SessionKey.from_bmdb(db)
    assert key.forms_allowed("a.1.m", key.csrf("a.1.m"))
    assert not key.forms_allowed("a.1.m", key.csrf("b.1.m"))
    assert not key.forms_allowed(None, key.csrf("a.1.m"))
    assert not key.forms_allowed("a.1.m", None)
    assert not key.forms_allowed("a.1.m", "")
