"""docker-compose.yml, checked without a Docker engine: structure, health, and one set of commands.

The worker and beat commands in the compose file must be the very commands ``scripts/demo``
runs (``example_worker/demo.py``), so that what the demo and its test prove is what the
compose stack runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from example_worker.demo import BEAT_COMMAND, WORKER_COMMAND, WORKER_NAMES, beat_command, worker_command

ROOT = Path(__file__).resolve().parents[1]
APP_SERVICES = (*WORKER_NAMES, "beat")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The parsed compose file (YAML anchors and merge keys resolved)."""
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    """One service's definition."""
    services: dict[str, Any] = compose["services"]
    assert name in services, f"docker-compose.yml has no service {name!r}"
    definition: dict[str, Any] = services[name]
    return definition


def test_services_are_the_servers_two_workers_and_beat(compose: dict[str, Any]) -> None:
    """The stack is PostgreSQL, Redis, one service per demo worker, beat, and an opt-in demo."""
    assert set(compose["services"]) == {"postgres", "redis", *APP_SERVICES, "demo"}
    assert service(compose, "demo").get("profiles") == ["demo"], "the demo must not start with `up`"


def test_servers_have_health_checks(compose: dict[str, Any]) -> None:
    """PostgreSQL is checked with pg_isready and Redis with redis-cli ping."""
    postgres = service(compose, "postgres")["healthcheck"]["test"]
    redis = service(compose, "redis")["healthcheck"]["test"]
    assert "pg_isready" in " ".join(postgres)
    assert redis[0] == "CMD"
    assert redis[1:] == ["redis-cli", "ping"]


@pytest.mark.parametrize("name", [*APP_SERVICES, "demo"])
def test_app_services_wait_for_healthy_servers(compose: dict[str, Any], name: str) -> None:
    """Workers, beat and the demo start only once PostgreSQL and Redis report healthy."""
    depends = service(compose, name)["depends_on"]
    for server in ("postgres", "redis"):
        assert depends[server] == {"condition": "service_healthy"}


def test_demo_waits_for_healthy_workers(compose: dict[str, Any]) -> None:
    """The demo service sends work only once both workers answer a ping."""
    depends = service(compose, "demo")["depends_on"]
    for name in WORKER_NAMES:
        assert depends[name] == {"condition": "service_healthy"}
        test = service(compose, name)["healthcheck"]["test"]
        assert test[:6] == ["CMD", "celery", "-A", "example_worker.app", "inspect", "ping"]
        assert f"{name}@{service(compose, name)['hostname']}" in test


@pytest.mark.parametrize("name", WORKER_NAMES)
def test_worker_commands_are_the_demos(compose: dict[str, Any], name: str) -> None:
    """Each worker service runs exactly the command scripts/demo runs for that worker."""
    command = service(compose, name)["command"]
    assert command == worker_command(name)
    assert tuple(command[: len(WORKER_COMMAND)]) == WORKER_COMMAND


def test_beat_command_is_the_demos(compose: dict[str, Any]) -> None:
    """The beat service runs exactly the command scripts/demo runs for beat."""
    assert service(compose, "beat")["command"] == beat_command() == list(BEAT_COMMAND)


def test_demo_service_attaches_to_the_running_workers(compose: dict[str, Any]) -> None:
    """The demo service runs the demo driver without starting workers of its own."""
    expected = ["python", "-m", "example_worker.demo", "--attach", "--short"]
    assert service(compose, "demo")["command"] == expected


@pytest.mark.parametrize("name", [*APP_SERVICES, "demo"])
def test_lock_backend_is_postgres_unless_switched(compose: dict[str, Any], name: str) -> None:
    """Locks live in PostgreSQL by default and in Redis with LOCK_BACKEND=redis; URLs name the services."""
    env = service(compose, name)["environment"]
    assert env["EXAMPLE_LOCK_BACKEND"] == "${LOCK_BACKEND:-postgres}"
    assert env["EXAMPLE_POSTGRES_URL"].startswith("postgresql+psycopg://")
    assert "@postgres:5432/" in env["EXAMPLE_POSTGRES_URL"]
    assert env["EXAMPLE_REDIS_URL"].startswith("redis://redis:6379/")
    assert env["EXAMPLE_BROKER_URL"].startswith("redis://redis:6379/")
    assert env["EXAMPLE_DATA_DIR"] == "/data"
    assert "example-data:/data" in service(compose, name)["volumes"]


@pytest.mark.parametrize("name", [*APP_SERVICES, "demo"])
def test_app_services_build_the_example_image(compose: dict[str, Any], name: str) -> None:
    """Every app service builds from the repository root with example_worker/Dockerfile."""
    build = service(compose, name)["build"]
    assert build == {"context": ".", "dockerfile": "example_worker/Dockerfile"}
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()


def test_dockerfile_installs_the_package_with_both_drivers() -> None:
    """The image is python:3.12-slim with the package installed with its postgres and redis extras."""
    lines = [line.strip() for line in (ROOT / "example_worker" / "Dockerfile").read_text().splitlines()]
    assert "FROM python:3.12-slim" in lines
    assert 'RUN pip install ".[postgres,redis]"' in lines
    assert "COPY example_worker ./example_worker" in lines
