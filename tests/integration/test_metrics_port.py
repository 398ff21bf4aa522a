"""``run_timer_shards --metrics-port`` stops with a clear error, not a traceback (issue 18).

The command runs in-process with ``call_command``; a socket bound to a free port makes
that port "in use". The worker must refuse before it starts (nothing to stop after).
"""

from __future__ import annotations

import gc
import signal
import socket
from collections.abc import Iterator

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from durable.metrics import MetricsPortInUse, WorkerMetrics

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _restore_signal_handlers() -> Iterator[None]:
    """Should the command get as far as starting, undo its signal handlers and GC freeze."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    gc.unfreeze()


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port some other socket is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def run_worker(*args: str) -> None:
    call_command("run_timer_shards", "--skip-checks", "--duration", "0", *args)


def test_a_port_in_use_is_a_command_error(busy_port):
    with pytest.raises(CommandError, match=f"--metrics-port: port {busy_port} is in use"):
        run_worker("--metrics-port", str(busy_port))


@pytest.mark.parametrize("port", ["0", "65536", "70000", "-1"])
def test_a_port_out_of_range_is_a_command_error(port):
    with pytest.raises(CommandError, match=rf"--metrics-port: {port} is not a port number"):
        run_worker("--metrics-port", port)


def test_an_address_this_host_does_not_have_is_a_command_error():
    # 192.0.2.0/24 is TEST-NET-1: documentation only, never assigned to an interface.
    with pytest.raises(CommandError, match="--metrics-port/--metrics-host: cannot serve"):
        run_worker("--metrics-port", "9", "--metrics-host", "192.0.2.1")


def test_serve_names_the_problem(busy_port):
    metrics = WorkerMetrics()
    with pytest.raises(MetricsPortInUse, match=f"port {busy_port} is in use on 127.0.0.1"):
        metrics.serve(busy_port)
    for bad in (-1, 65_536, True, "9108"):
        with pytest.raises(ValueError, match=r"port: expected an integer in 0\.\.65535"):
            metrics.serve(bad)  # type: ignore[arg-type]
