"""Keeping secrets out of what the shepherd prints, logs and stores.

Two kinds of secret reach such text:

* credentials inside URLs (the BMDB URL's password, a broker's, user info in a
  provider URL): whatever shows a URL shows ``redact_url(url)``, never the URL;
* the provider's API token, which an API may echo in its error texts: the provider
  client passes every error text through ``scrub(text, token)`` before raising it.

Why not SQLAlchemy's ``render_as_string(hide_password=True)``: it splits the user
info at the *first* ``@``, so a password with an unencoded ``@`` is shown in part as
the host and database (``u:p@ss/word@db`` renders as ``u:***@ss/word%40db``), and a
``?password=`` query parameter is shown as it is.
"""

from __future__ import annotations

import json
import re
from urllib.parse import quote, quote_plus, unquote

HIDDEN = "***"
#: Runs of at least this many characters of a secret are hidden too (an API that
#: echoes a token cut short); shorter secrets are only hidden whole.
PIECE = 8

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_PLAIN_USER = re.compile(r"[A-Za-z0-9._~+-]+")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]*\]|[A-Za-z0-9._~-]*)(:[0-9]*)?(?=[/?#]|$)")
_SECRET_PARAM = re.compile(
    r"(?i)([?&;][^=&;#]*(?:pass|pwd|secret|token|key|auth|credential|signature)[^=&;#]*=)"
    r"[^&;#]*")


def redact_url(text: str) -> str:
    """``text`` (a URL, or what was meant to be one) without its credentials.

    The user info is taken to end at the *last* ``@`` (any ``@`` before it belongs to
    a password that was not percent-encoded), and is hidden whole (``***@``) when in
    doubt: unless it is a plain ``user:password`` (no other ``@``) in front of a plain
    host and port, only then is the user name kept (``user:***@``). A user info
    without ``:`` may itself be a token (``https://TOKEN@host``), so it is hidden. Query parameters
    whose name says password, token, secret, key... keep their name only.
    Why this rule: it needs no parser to agree with the one that will read the URL,
    so no part of a badly written password can come out as a host or path.
    """
    scheme, sep, rest = text.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        if "@" in text:  # not a URL we can read: all before the last '@' may be credentials
            return f"{HIDDEN}@{_hide_params(text.rpartition('@')[2])}"
        return _hide_params(text)
    if rest.startswith("/") or "@" not in rest:  # no authority (sqlite:///...) or no user info
        return f"{scheme}://{_hide_params(rest)}"
    userinfo, _, after = rest.rpartition("@")
    user, colon, _password = userinfo.partition(":")
    keep_user = (bool(colon) and "@" not in userinfo and _PLAIN_USER.fullmatch(user)
                 and _HOST_PORT.match(after))
    shown = f"{user}:{HIDDEN}" if keep_user else HIDDEN
    return f"{scheme}://{shown}@{_hide_params(after)}"


def _hide_params(part: str) -> str:
    head, mark, query = part.partition("?")
    if not mark:
        return part
    return head + _SECRET_PARAM.sub(lambda m: m.group(1) + HIDDEN, "?" + query)


def database_url_problem(text: str) -> str | None:
    """Why SQLAlchemy would not read the user and password written in ``text``, or None.

    SQLAlchemy ends the password at the first ``@`` and the user name at the first
    ``:`` or ``/``, so an unencoded ``@`` makes the rest of the password the host and
    database: connecting would fail with an error naming them, i.e. printing part of
    the password. Such a URL is refused before any connection (``shepherd.runtime``,
    the CLI) with this reason; an unparsable one is left to the caller's parser.
    """
    _, sep, rest = text.partition("://")
    if not sep or rest.startswith("/") or "@" not in rest:
        return None
    import bmdb  # lazily: redaction is for every command, most never open the BMDB

    try:
        url = bmdb.parse_url(text)
    except bmdb.BadURL:
        return None
    user, colon, password = rest.rpartition("@")[0].partition(":")
    if (url.username, url.password) == (unquote(user), unquote(password) if colon else None):
        return None
    return ("its user info holds a character that must be percent-encoded: '@' as %40 "
            "(and in the user name ':' as %3A, '/' as %2F)")


def url_problem(text: str) -> str | None:
    """Why a parser built on ``urllib`` (kombu and Celery for the broker and result
    backend URLs, redis-py) would misread the user info of ``text``, or None.

    ``urllib`` ends the host part at the first '/', '?' or '#' and the user info at
    the last '@' before it: a password holding one of those (a base64 one often
    holds '/') comes out in part as the port or the path, and kombu's error for the
    bad port quotes it. Percent-encoded, each is read right.
    """
    _, sep, rest = text.partition("://")
    if not sep or rest.startswith("/") or "@" not in rest:
        return None
    userinfo = rest.rpartition("@")[0]
    odd = [char for char in "@/?#" if char in userinfo]
    if not odd:
        return None
    return (f"its user info holds {', '.join(repr(c) for c in odd)}, which must be "
            "percent-encoded ('@' as %40, '/' as %2F, '?' as %3F, '#' as %23)")


def scrub(text: str, *secrets: str) -> str:
    """``text`` with each of ``secrets`` replaced by ``***``: as it is, percent-encoded,
    JSON-escaped, and any run of ``PIECE`` or more of its characters.

    Why the runs: an API that echoes a token may cut it short or wrap it, and a
    prefix of a token is still most of a secret. Run before ``text`` is shortened
    (a cut could leave a prefix too short to be recognised).
    """
    for secret in secrets:
        if not secret:
            continue
        for form in sorted({secret, quote(secret, safe=""), quote_plus(secret),
                            json.dumps(secret)[1:-1]}, key=len, reverse=True):
            text = text.replace(form, HIDDEN)
        if len(secret) > PIECE:
            text = _hide_runs(text, secret)
    return text


def _hide_runs(text: str, secret: str) -> str:
    """Hide every stretch of ``text`` covered by ``PIECE``-character slices of ``secret``
    (linear in ``text``: one set look-up per position)."""
    slices = {secret[i:i + PIECE] for i in range(len(secret) - PIECE + 1)}
    covered = [False] * len(text)
    for i in range(len(text) - PIECE + 1):
        if text[i:i + PIECE] in slices:
            covered[i:i + PIECE] = [True] * PIECE
    if not any(covered):
        return text
    out: list[str] = []
    for i, char in enumerate(text):
        if not covered[i]:
            out.append(char)
        elif i == 0 or not covered[i - 1]:
            out.append(HIDDEN)
    return "".join(out)
