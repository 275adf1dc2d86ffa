"""``shepherd token create|list|revoke``: the operators' API tokens (direct mode only:
whoever manages tokens owns the BMDB; ``shepherd.operations.tokens`` says how a token
is kept)."""

from __future__ import annotations

import sys

import bmdb
from shepherd import text_tables
from shepherd.cli.actions import actor
from shepherd.cli.context import Context, Failed
from shepherd.operations import tokens


def create(ctx: Context) -> int:
    """Print a new token, once, alone on stdout (``TOKEN=$(shepherd token create ...)``),
    and what it is on stderr. No ``--json``: a token never appears in JSON output,
    where it would be logged and kept by whatever collects a script's output."""
    role = tokens.parse_role(ctx.args.role)
    expires = tokens.parse_expiry(ctx.args.expires) if ctx.args.expires else None
    token, record = tokens.create(ctx.runtime.session, ctx.args.name, role, expires,
                                  actor(ctx))
    until = f"until {record.expires_at:%Y-%m-%d %H:%M} UTC" if record.expires_at else \
        "with no expiry"
    print(token)
    print(f"token {record.name!r}, role {record.role}, {until}: shown only now; give it "
          "as SHEPHERD_API_TOKEN, or in the file SHEPHERD_API_TOKEN_FILE names",
          file=sys.stderr)
    return 0


def listed(ctx: Context) -> int:
    now, found = ctx.db.read(lambda tx: (tx.now, bmdb.list_tokens(tx)))
    rows = [(t.name, t.role, "live" if t.live(now) else
             ("revoked" if t.revoked_at else "expired"),
             f"{t.created_at:%Y-%m-%d %H:%M}", t.created_by,
             f"{t.expires_at:%Y-%m-%d %H:%M}" if t.expires_at else "-") for t in found]
    ctx.emit({"tokens": found}, lambda: text_tables.table(
        ["NAME", "ROLE", "STATE", "CREATED", "BY", "EXPIRES"], rows) if rows
        else "no tokens (shepherd token create NAME --role viewer|operator|admin)")
    return 0


def revoke(ctx: Context) -> int:
    name = ctx.args.name
    if not ctx.runtime.session.transact(lambda tx: bmdb.revoke_token(tx, name)):
        raise Failed(f"no live token named {name!r} (shepherd token list)")
    ctx.emit({"name": name, "revoked": True}, lambda: f"token {name!r} revoked")
    return 0
