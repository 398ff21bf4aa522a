#!/usr/bin/env bash
# Create the PostgreSQL role and database the test suite uses (idempotent).
# The role may create databases: pytest-django creates test_durable from it.
set -euo pipefail
PGHOST=${PGHOST:-127.0.0.1}
PGPORT=${PGPORT:-5432}
PGSUPER=${PGSUPER:-postgres}
psql_super() { psql -v ON_ERROR_STOP=1 -h "$PGHOST" -p "$PGPORT" -U "$PGSUPER" -d postgres -tAc "$1"; }
if [ "$(psql_super "SELECT 1 FROM pg_roles WHERE rolname='durable'")" != "1" ]; then
  psql_super "CREATE ROLE durable LOGIN PASSWORD 'durable' CREATEDB"
fi
if [ "$(psql_super "SELECT 1 FROM pg_database WHERE datname='durable'")" != "1" ]; then
  psql_super "CREATE DATABASE durable OWNER durable"
fi
echo "PostgreSQL role and database 'durable' ready on $PGHOST:$PGPORT"
