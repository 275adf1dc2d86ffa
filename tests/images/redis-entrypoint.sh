#!/bin/sh
# The part of redis:7-bookworm's docker-entrypoint.sh that docker/compose.yaml uses:
# as root, own /data and run as redis; `redis-server` without a configuration file
# leaves protected mode, so that other containers (not only loopback) may connect.
set -eu

if [ "${1:-}" = redis-server ] && [ "$(id -u)" = 0 ]; then
    chown -R redis:redis .
    exec setpriv --reuid=redis --regid=redis --init-groups "$0" "$@"
fi

if [ "${1:-}" = redis-server ]; then
    case "${2:-}" in
        *.conf) ;;
        *) shift; set -- redis-server --protected-mode no "$@" ;;
    esac
fi

exec "$@"
