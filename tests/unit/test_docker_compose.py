"""docker-compose.yml cannot run here (no Docker engine), so its shape is checked instead."""

from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _services():
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_has_the_cluster():
    services = _services()
    assert {"postgres", "rabbitmq", "web", "worker-1", "worker-2"} <= set(services)


def test_app_services_are_configured_only_through_environment():
    services = _services()
    for name in ("web", "worker-1", "worker-2"):
        svc = services[name]
        env = svc["environment"]
        assert env["DATABASE_URL"].startswith("postgres://"), name
        assert "@postgres:5432/" in env["DATABASE_URL"], name
        assert "DJANGO_SECRET_KEY" in env, name
        assert "volumes" not in svc, f"{name} must not be configured by mounted files"
        assert "postgres" in svc["depends_on"], name


def test_workers_run_the_worker_command_with_distinct_node_names():
    services = _services()
    commands = [services[n]["command"] for n in ("worker-1", "worker-2")]
    for command in commands:
        assert "run_timer_shards" in command
    nodes = {services[n]["environment"]["DURABLE_NODE"] for n in ("worker-1", "worker-2")}
    assert len(nodes) == 2
