"""The settings of the CLI in API mode: where the operators' API is and the token to
show it, read without ``shepherd.config``.

Why a reader of its own (``shepherd.config.Settings`` is the environment's reader
everywhere else): ``Settings`` names the BMDB's types, so reading it imports
SQLAlchemy, a third of a second that API mode exists to save. The rules are the same:
the process's environment over the state directory's ``shepherd.env``
(``state_env``), and a secret from ``<NAME>_FILE`` when ``<NAME>`` is not set.

* ``SHEPHERD_API_URL``: the operators' listener (``https://host:port``); set, it
  puts every command the API serves in API mode.
* ``SHEPHERD_API_TOKEN``, or ``SHEPHERD_API_TOKEN_FILE`` naming a file holding it.
* ``SHEPHERD_API_CA_FILE``: the CA that signed the listener's certificate, when it
  is not one the system trusts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shepherd import state_env

URL = "SHEPHERD_API_URL"
TOKEN = "SHEPHERD_API_TOKEN"
TOKEN_FILE = "SHEPHERD_API_TOKEN_FILE"
CA_FILE = "SHEPHERD_API_CA_FILE"
#: Every variable read here (none of them a ``Settings`` field).
VARIABLES = (URL, TOKEN, TOKEN_FILE, CA_FILE)


class ClientSettingsError(ValueError):
    """A setting cannot be used; the message names it."""


@dataclass(frozen=True)
class ClientSettings:
    url: str | None
    token: str | None
    ca_file: str | None
    #: The state directory whose file gave the URL (a ``shepherd up``'s), else None.
    url_from: Path | None = None

    @classmethod
    def from_env(cls, state_dir: Path | None = None) -> ClientSettings:
        """From the environment over ``state_dir``'s (else the usual one's) state file."""
        own = dict(os.environ)
        if state_dir is not None:
            own[state_env.STATE_DIR_VARIABLE] = str(state_dir)
        try:
            env = state_env.environment(own)
        except state_env.StateFileError as error:
            raise ClientSettingsError(str(error)) from None
        url_from = None if own.get(URL) else state_env.state_dir(own)
        return cls(env.get(URL) or None, _token(env), env.get(CA_FILE) or None, url_from)


def _token(env: dict[str, str]) -> str | None:
    if env.get(TOKEN):
        return env[TOKEN].strip()
    path = env.get(TOKEN_FILE)
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError as error:
        raise ClientSettingsError(f"{TOKEN_FILE}: cannot read {path}: {error.strerror}"
                                  ) from None
