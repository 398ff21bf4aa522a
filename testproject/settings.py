"""Settings for the project that demonstrates and tests durable.

Configured only through environment variables (django-environ), so the same code runs
the SQLite demo, the test suites and the docker-compose cluster:

- ``DATABASE_URL``: defaults to a SQLite file beside ``manage.py``.
- ``DURABLE_LISTEN_DATABASE_URL``: set when ``DATABASE_URL`` goes through a pooler in
  transaction mode (PgBouncer): the same database reached directly, for the worker's
  LISTEN (alias ``"listen"``, ``DURABLE["LISTEN_DATABASE"]``); preparing stays off.
- ``DURABLE_SHARDS``, ``DURABLE_LEASE_TTL_S``, ``DURABLE_RESCAN_INTERVAL_S``,
  ``DURABLE_BATCH_TIME_BUDGET_S``: worker tuning.
- ``DURABLE_RETENTION_DAYS``: fired and cancelled timers' retention (the soak bench
  shortens it so that pruning runs throughout).
- ``DURABLE_RAFT``: ``DURABLE["RAFT"]`` as JSON (unset: Raft off).
- ``DURABLE_IMPORTS``: comma-separated modules the worker imports at start-up (handlers
  outside the apps' conventional modules).
- ``DJANGO_SECRET_KEY``, ``DJANGO_DEBUG``, ``DJANGO_ALLOWED_HOSTS``.
"""

from __future__ import annotations

import json
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()

SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="insecure-only-for-the-durable-test-project")
DEBUG = env.bool("DJANGO_DEBUG", default=True)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_prometheus",
    "durable",
    "testproject.demo",
]

MIDDLEWARE = [
    # Request metrics for the web side (the worker serves its own on --metrics-port).
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "testproject.urls"
WSGI_APPLICATION = "testproject.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded default: WAL lets the worker read while the web process writes, and
    # IMMEDIATE transactions take the write lock up front instead of failing on upgrade.
    DATABASES["default"]["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
    }
    # A file, not :memory:, so worker subprocesses in acceptance tests share it; named
    # after the main file so that runs with different DATABASE_URLs never collide.
    _main = Path(DATABASES["default"]["NAME"])
    DATABASES["default"]["TEST"] = {"NAME": str(_main.with_name(f"test_{_main.name}"))}
elif env.str("DURABLE_LISTEN_DATABASE_URL", default=""):
    # Behind PgBouncer in transaction mode: no protocol-level prepared statements (1.18
    # cannot carry them across transactions), no server-side cursors (they live in a
    # session), and LISTEN on a direct connection.
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    DATABASES["listen"] = env.db("DURABLE_LISTEN_DATABASE_URL")
    # A test run under this env must not create a second test database for the alias
    # (the acceptance tests hand their workers both URLs of the test database instead).
    DATABASES["listen"]["TEST"] = {"MIRROR": "default"}
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Let psycopg prepare the worker's hot statements (durable.storage.statements):
    # Django turns preparing off unless asked, for the sake of connection poolers in
    # transaction mode; this project talks to PostgreSQL directly.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("prepare_threshold", 5)

DURABLE = {
    "SHARDS": env.int("DURABLE_SHARDS", default=64),
    "LEASE_TTL_S": env.float("DURABLE_LEASE_TTL_S", default=10.0),
    "RESCAN_INTERVAL_S": env.float("DURABLE_RESCAN_INTERVAL_S", default=2.0),
    # Must stay below LEASE_TTL_S (durable.E005): tests run leases of 2 s.
    "BATCH_TIME_BUDGET_S": env.float("DURABLE_BATCH_TIME_BUDGET_S", default=2.0),
    "BROKER_URL": env.str("DURABLE_BROKER_URL", default="memory://"),
    "DISPATCH": env.str("DURABLE_DISPATCH", default="inline"),
    "ASYNC_COMMIT": env.bool("DURABLE_ASYNC_COMMIT", default=False),
    "LISTEN_DATABASE": "listen" if "listen" in DATABASES else None,
    "SHUTDOWN_GRACE_S": env.float("DURABLE_SHUTDOWN_GRACE_S", default=30.0),
    "RETENTION_DAYS": env.float("DURABLE_RETENTION_DAYS", default=7.0),
    # Handler modules the worker imports besides each app's handlers/workflows/crons/tasks
    # (the demo's load generators), plus DURABLE_IMPORTS: the acceptance tests' workers
    # fire handlers kept under tests/, which is not an app.
    "IMPORTS": [
        "testproject.demo.probes",
        "testproject.demo.poison",
        "testproject.demo.workload",
        "testproject.demo.chaos",
        *env.list("DURABLE_IMPORTS", default=[]),
    ],
    # Raft beside the leases (the Raft acceptance tests set it; off otherwise).
    "RAFT": json.loads(env.str("DURABLE_RAFT", default="null")),
}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "durable": {"handlers": ["console"], "level": env.str("DURABLE_LOG_LEVEL", default="INFO")}
    },
}
