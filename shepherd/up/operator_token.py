"""The demo's admin token: ``shepherd up`` makes one per run, so a second terminal's CLI
(and the web view's login) go through the operators' API as a team's would.

Each run revokes the previous run's token and makes a new one: the file in the state
directory (mode 0600, ``files.write_private``) always holds the live one, and a copy
taken from an earlier run stops working. Its path and the API's URL go into the state
file (``supervisor.hand_over``), where ``shepherd.client_settings`` reads them.
"""

from __future__ import annotations

from pathlib import Path

import bmdb
from shepherd import client_settings
from shepherd.files import write_private
from shepherd.operations import tokens
from shepherd.roles import Role

NAME = "up-admin"
FILE_NAME = "api-token"


def issue(db: bmdb.BMDB, workdir: Path) -> Path:
    """A new admin token in ``workdir/api-token``; the previous run's is revoked."""
    with db.start_session("shepherd-up", interval=10) as session:
        session.transact(lambda tx: bmdb.revoke_token(tx, NAME))
        token, _ = tokens.create(session, NAME, Role.ADMIN, None, "shepherd up")
    path = workdir / FILE_NAME
    write_private(path, token + "\n")
    return path


def state_settings(workdir: Path, api_url: str) -> dict[str, str]:
    """What the state file says of the API, when this run issued a token."""
    path = workdir / FILE_NAME
    if not path.exists():
        return {}
    return {client_settings.URL: api_url, client_settings.TOKEN_FILE: str(path.resolve())}
