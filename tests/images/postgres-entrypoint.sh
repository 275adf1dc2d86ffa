#!/bin/sh
# The part of postgres:15-bookworm's docker-entrypoint.sh that docker/compose.yaml uses:
# as root, own PGDATA and the socket directory, then run as postgres; on an empty
# PGDATA, initdb with POSTGRES_USER (default postgres) and POSTGRES_PASSWORD (required),
# password (scram-sha-256) logins from any address, and POSTGRES_DB (default the user's
# name) created. Anything but `postgres ...` runs as given.
set -eu

if [ "${1:-}" != postgres ]; then
    exec "$@"
fi

if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /var/run/postgresql
    chown -R postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?is required on first start (the image's contract)}"
    user=${POSTGRES_USER:-postgres}
    database=${POSTGRES_DB:-$user}
    password_file=$(mktemp)
    printf '%s' "$POSTGRES_PASSWORD" > "$password_file"
    initdb --username="$user" --pwfile="$password_file" --encoding=UTF8 \
        --auth-local=trust --auth-host=scram-sha-256 -D "$PGDATA" >/dev/null
    rm -f "$password_file"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    if [ "$database" != postgres ]; then
        # Not listening on the network yet: no client can come in half-initialised.
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        psql -v ON_ERROR_STOP=1 --username="$user" --dbname=postgres \
            -c "CREATE DATABASE \"$database\"" >/dev/null
        pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
    echo "postgres stand-in: initialised $PGDATA for $user, database $database"
fi

exec "$@"
