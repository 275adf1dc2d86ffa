#!/bin/sh
# The Shepherd agent as uploaded: this shell prologue, then a zip archive that python3
# runs as an application (shepherd/agent/bundle.py). The initializer runs it as
# `/bin/sh FILE ARGS...` so that neither the exec bit, nor /usr/bin/env, nor the
# login shell's own language matters. Kept to POSIX sh; the shell never reads past
# `exit`, so the binary part after it is Python's alone.
if command -v python3 >/dev/null 2>&1; then
    exec python3 "$0" "$@"
fi
echo '{"error": {"message": "python3 is not installed on this machine: the Shepherd agent needs python3 3.9 or newer, nothing else"}}'
exit 1
