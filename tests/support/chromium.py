"""Headless Chromium for the web view's tests: ``chromium`` (its path, or the test
fails saying how to install it), ``BROWSER_FLAGS``, and ``devtools``, a browser
driven over the DevTools protocol (``Devtools``): what a page really did, a form
filled in and sent as a person would.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BROWSER_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1366,900")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Chromium is missing: install it with `apt-get install -y chromium` "
                    "(./dev test does as root)")
    return path


#: Collects every CSP violation the page meets (an injected script: DevTools' own
#: scripts are exempt from the page's policy, the page's are not).
RECORD_VIOLATIONS = ("window.__violations = [];"
                     "document.addEventListener('securitypolicyviolation', e => "
                     "window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));")


class Devtools:
    """A headless Chromium driven over the DevTools protocol on a pipe
    (``--remote-debugging-pipe``: fd 3 in, fd 4 out, NUL-separated JSON): what the
    page really did, which ``--dump-dom`` cannot say (a stylesheet refused, a style
    that did not apply, a CSP violation)."""

    def __init__(self, chromium: str, profile: Path) -> None:
        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()
        # Chromium reads fd 3 and writes fd 4: bash puts the pipe ends there (no
        # preexec_fn, which is unsafe with the server's threads in this process).
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child, from_child)]
        for fd in (to_child, from_child):
            os.close(fd)
        self.process = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{high[0]} 4>&{high[1]} {high[0]}<&- {high[1]}>&-',
             "bash", chromium, *BROWSER_FLAGS, f"--user-data-dir={profile}",
             "--remote-debugging-pipe", "about:blank"],
            pass_fds=high, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in high:
            os.close(fd)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=self.session)
        self.call("Page.addScriptToEvaluateOnNewDocument", source=RECORD_VIOLATIONS,
                  session=self.session)

    def call(self, method: str, session: str | None = None, **params: object) -> dict:
        self._next_id += 1
        message: dict = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        answer = self._wait(lambda m: m.get("id") == self._next_id)
        assert "error" not in answer, answer
        return answer["result"]

    def _wait(self, wanted, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "method" in message:
                    self.events.append(message)
                if wanted(message):
                    return message
            left = deadline - time.monotonic()
            assert left > 0, "Chromium did not answer in time"
            if select.select([self._in], [], [], left)[0]:
                chunk = os.read(self._in, 1 << 16)
                assert chunk, "Chromium closed the DevTools pipe"
                self._buffer += chunk

    def load(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", url=url, session=self.session)
        self._wait(lambda m: m.get("method") == "Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           session=self.session)
        return result["result"].get("value")

    def cookies(self) -> list[dict]:
        """Every cookie the browser holds, with its flags (httpOnly, sameSite...)."""
        found: list[dict] = self.call("Storage.getCookies")["cookies"]
        return found

    def submit(self, form: str, **fields: object) -> None:
        """Fill ``fields`` of the form ``form`` (a selector) and send it as a click
        would; returns once the answer's page loaded."""
        script = "".join(f"document.querySelector({json.dumps(form)})"
                         f".elements[{json.dumps(k)}].value = {json.dumps(v)};"
                         for k, v in fields.items())
        self.events.clear()
        self.evaluate(script + f"document.querySelector({json.dumps(form)}).submit();")
        self._wait(lambda m: m.get("method") == "Page.loadEventFired")

    def exists(self, selector: str) -> bool:
        return bool(self.evaluate(f"!!document.querySelector({json.dumps(selector)})"))

    def violations(self) -> list[str]:
        """The page's CSP violations, and any console line about the policy."""
        seen = list(self.evaluate("window.__violations") or [])
        return seen + [e["params"]["entry"]["text"] for e in self.events
                       if e["method"] == "Log.entryAdded"
                       and "Content Security Policy" in e["params"]["entry"]["text"]]

    def style(self, selector: str, prop: str) -> str:
        return self.evaluate(f"getComputedStyle(document.querySelector({json.dumps(selector)}))"
                             f".getPropertyValue({json.dumps(prop)})")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close")
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        os.close(self._in)
        os.close(self._out)


@pytest.fixture
def devtools(chromium: str, tmp_path: Path) -> Iterator[Devtools]:
    browser = Devtools(chromium, tmp_path / "devtools")
    try:
        yield browser
    finally:
        browser.close()
