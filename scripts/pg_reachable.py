"""Exit 0 when the PostgreSQL URL given as argv[1] accepts a connection, 1 otherwise."""

import sys

import environ
import psycopg


def main() -> int:
    cfg = environ.Env.db_url_config(sys.argv[1])
    try:
        psycopg.connect(
            dbname=cfg["NAME"],
            user=cfg.get("USER") or None,
            password=cfg.get("PASSWORD") or None,
            host=cfg.get("HOST") or None,
            port=cfg.get("PORT") or None,
            connect_timeout=3,
        ).close()
    except psycopg.Error as exc:
        print(f"PostgreSQL not reachable: {exc}".strip(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
