"""The agent bundle's ``__main__.py``: a gate any python3 can parse.

The agent itself (``shepherd_agent`` in the bundle, ``agent.py`` here) and its wire
format (``protocol``) use syntax and modules of Python 3.9. On an older python3 the
agent would die with a SyntaxError on stderr; this gate answers the TakeoverResponse
error the initializer records instead. So: no annotations beyond Python 3.0's, no
f-strings, no imports at the top but ``sys``.
"""

import sys

MINIMUM = (3, 9)


def main() -> int:
    if sys.version_info < MINIMUM:
        version = sys.version.split()[0]
        sys.stdout.write(
            '{"error": {"message": "python3 %s is too old: the Shepherd agent needs'  # noqa: UP031
            ' 3.9 or newer"}}\n' % version)
        sys.stdout.flush()
        return 1
    import shepherd_agent  # type: ignore[import-not-found]  # the bundle's agent.py

    return int(shepherd_agent.main())


if __name__ == "__main__":
    sys.exit(main())
