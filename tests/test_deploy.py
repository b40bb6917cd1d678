"""Deployment files: docker-compose.yml, deploy/Dockerfile, .dockerignore and deploy/k8s/.

There is no Docker engine in CI, so these files are parsed and checked for what running them
relies on: the services and how they wait for each other, the image's layout (alembic.ini and
migrations/ beside the installed packages), a non-root user, probes on /healthz and /readyz, and
every `MEMSTRATA_*` variable being a real `Settings` field with a value `Settings` accepts.
"""

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S = ROOT / "deploy" / "k8s"
ENV_PREFIX = "MEMSTRATA_"
# What the image needs from the build context, at the repository's layout.
IMAGE_SOURCES = ("alembic.ini", "migrations", "gateway", "memory", "pyproject.toml", "README.md")


# --- compose -------------------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>\w+)(?::?[-?](?P<default>[^}]*))?\}")


def _interpolate(value: object) -> str:
    """`value` as Compose would pass it with an empty host environment: defaults applied."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return match.group("default") or ""

    return _VARIABLE.sub(replace, str(value))


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _service(name: str) -> dict[str, Any]:
    service = _compose()["services"][name]
    assert isinstance(service, dict)
    return service


def _environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment (mapping or `KEY=value` list), interpolated."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: _interpolate(value) for key, value in env.items()}


def _command(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(part) for part in value]


def _port_mappings(service: dict[str, Any]) -> list[tuple[int, int]]:
    """(host, container) pairs of a service's `ports`, short or long syntax."""
    pairs = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            pairs.append((int(port["published"]), int(port["target"])))
        else:
            *_, host, container = str(port).split(":")
            pairs.append((int(host), int(container.split("/")[0])))
    return pairs


def _gateway_port() -> int:
    ((_, container),) = _port_mappings(_service("gateway"))
    return container


# --- Dockerfile ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    name: str
    args: str


def _instructions() -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        name, _, args = (pending + stripped).partition(" ")
        instructions.append(Instruction(name.upper(), args.strip()))
        pending = ""
    return instructions


def _stages() -> list[list[Instruction]]:
    """Each stage's instructions, its FROM first."""
    stages: list[list[Instruction]] = []
    for instruction in _instructions():
        if instruction.name == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    assert stages, "the Dockerfile has no FROM"
    return stages


def _final_stage() -> list[Instruction]:
    return _stages()[-1]


def _exec_form(args: str) -> list[str]:
    assert args.startswith("["), f"use the exec (JSON) form, not a shell string: {args}"
    value = json.loads(args)
    assert isinstance(value, list)
    return value


def _env(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in stage:
        if instruction.name != "ENV":
            continue
        tokens = shlex.split(instruction.args)
        if "=" not in tokens[0]:  # legacy `ENV KEY value`
            env[tokens[0]] = " ".join(tokens[1:])
            continue
        for token in tokens:
            key, _, value = token.partition("=")
            env[key] = value
    return env


def _copy_targets(stage: list[Instruction]) -> dict[str, PurePosixPath]:
    """Where each build-context source of the stage's COPY lands in the image."""
    targets: dict[str, PurePosixPath] = {}
    workdir = PurePosixPath("/")
    for instruction in stage:
        if instruction.name == "WORKDIR":
            workdir = workdir / instruction.args
        if instruction.name not in {"COPY", "ADD"}:
            continue
        tokens = shlex.split(instruction.args)
        if any(token.startswith("--from") for token in tokens):
            continue
        *sources, dest = [token for token in tokens if not token.startswith("--")]
        into = workdir / dest
        for source in sources:
            name = source.rstrip("/").removeprefix("./")
            is_dir = (ROOT / name).is_dir()
            into_dir = dest.endswith("/") or dest in {".", "./"} or len(sources) > 1
            targets[name] = into if is_dir or not into_dir else into / name
    return targets


def _workdir_of(stage: list[Instruction], wanted: Instruction) -> PurePosixPath:
    workdir = PurePosixPath("/")
    for instruction in stage:
        if instruction.name == "WORKDIR":
            workdir = workdir / instruction.args
        if instruction is wanted:
            return workdir
    raise AssertionError(f"{wanted} is not in the stage")


def _healthcheck_command(stage: list[Instruction]) -> list[str]:
    (check,) = [i for i in stage if i.name == "HEALTHCHECK"]
    options, found, command = check.args.partition("CMD ")
    assert found, f"HEALTHCHECK has no CMD: {check.args}"
    assert "NONE" not in options.upper()
    return _exec_form(command.strip())


# --- Kubernetes ----------------------------------------------------------------------------------


def _manifests(name: str) -> list[dict[str, Any]]:
    documents = [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc is not None]
    assert documents, f"{name} holds no manifest"
    return documents


def _one(name: str, kind: str) -> dict[str, Any]:
    (document,) = [doc for doc in _manifests(name) if doc["kind"] == kind]
    return document


def _containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    (container,) = containers
    return container


def _k8s_env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


def _all_env_keys() -> Iterator[tuple[str, str]]:
    """(where, key) of every environment variable set in compose, Dockerfile and manifests."""
    for name, service in _compose()["services"].items():
        for key in _environment(service):
            yield f"compose service {name}", key
    for key in _env(_final_stage()):
        yield "Dockerfile", key
    for path in sorted(K8S.glob("*.yaml")):
        for document in _manifests(path.name):
            if document["kind"] != "Deployment":
                continue
            for container in _containers(document):
                for key in _k8s_env(container):
                    yield f"{path.name} container {container['name']}", key


def _settings_from(env: dict[str, str]) -> Settings:
    """`Settings` built from the MEMSTRATA_* part of `env` alone (no .env, no process env)."""
    values = {
        key.removeprefix(ENV_PREFIX).lower(): value
        for key, value in env.items()
        if key.startswith(ENV_PREFIX)
    }
    # model_validate skips the settings sources: the values are validated, nothing else is read.
    return Settings.model_validate(values)


# --- compose tests -------------------------------------------------------------------------------


def test_compose_has_db_gateway_and_worker_restarting_unless_stopped() -> None:
    services = _compose()["services"]
    assert {"db", "gateway", "worker"} <= set(services)
    for name in ("db", "gateway", "worker"):
        assert services[name].get("restart") == "unless-stopped", name


def test_db_is_pgvector_with_its_data_on_a_named_volume() -> None:
    compose, db = _compose(), _service("db")
    assert db["image"].startswith("pgvector/pgvector:"), db["image"]
    env = _environment(db)
    assert env.get("POSTGRES_USER") and env.get("POSTGRES_PASSWORD") and env.get("POSTGRES_DB")
    mounts: dict[str, str] = {}
    for volume in db.get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = volume["source"]
        else:
            source, target = str(volume).split(":")[:2]
            mounts[target] = source
    data = mounts.get("/var/lib/postgresql/data")
    assert data is not None, f"nothing mounted on the data directory: {mounts}"
    assert data in (compose.get("volumes") or {}), f"{data} is not a named volume"


def test_db_and_gateway_have_healthchecks_and_the_worker_opts_out() -> None:
    db, gateway, worker = _service("db"), _service("gateway"), _service("worker")
    db_test = " ".join(_command(db["healthcheck"]["test"]))
    assert f"pg_isready -U {_environment(db)['POSTGRES_USER']}" in db_test
    assert not gateway["healthcheck"].get("disable")
    gateway_test = " ".join(_command(gateway["healthcheck"]["test"]))
    assert f":{_gateway_port()}/healthz" in gateway_test
    # The worker serves no HTTP: the image's /healthz HEALTHCHECK would mark it unhealthy forever.
    assert worker.get("healthcheck", {}).get("disable") is True


def test_gateway_and_worker_run_the_same_image_built_from_deploy_dockerfile() -> None:
    gateway, worker = _service("gateway"), _service("worker")
    assert gateway["image"] == worker["image"] == "memstrata:latest"
    assert gateway["build"] == worker.get("build", gateway["build"])
    assert gateway["build"]["context"] == "."
    assert (ROOT / gateway["build"]["context"] / gateway["build"]["dockerfile"]) == DOCKERFILE


def test_gateway_and_worker_use_the_db_service_as_their_database() -> None:
    db_env = _environment(_service("db"))
    urls = {
        name: _environment(_service(name))["MEMSTRATA_DATABASE_URL"]
        for name in ("gateway", "worker")
    }
    assert urls["gateway"] == urls["worker"]
    url = urlsplit(urls["gateway"])
    assert url.scheme == "postgresql"
    assert url.hostname == "db"
    assert url.port in (None, 5432)
    assert url.username == db_env["POSTGRES_USER"]
    assert url.password == db_env["POSTGRES_PASSWORD"]
    assert url.path == f"/{db_env['POSTGRES_DB']}"


def test_upstream_comes_from_the_host_openai_variables() -> None:
    for name in ("gateway", "worker"):
        env = _service(name)["environment"]
        assert env["MEMSTRATA_UPSTREAM_BASE_URL"] == "${OPENAI_BASE_URL:-https://api.openai.com/v1}"
        assert env["MEMSTRATA_UPSTREAM_API_KEY"] == "${OPENAI_API_KEY:-}"


def test_gateway_listens_on_all_interfaces_on_the_mapped_port_without_workers() -> None:
    settings = _settings_from(_env(_final_stage()) | _environment(_service("gateway")))
    assert settings.host == "0.0.0.0"
    assert settings.port == _gateway_port()
    assert settings.workers == 0, "a worker service exists: the gateway runs none in-process"
    assert settings.database_url is not None
    assert _command(_service("gateway").get("command")) in ([], ["memstrata", "serve"])


def test_worker_runs_memstrata_worker() -> None:
    assert _command(_service("worker").get("command")) == ["memstrata", "worker"]


def test_services_wait_for_what_they_need() -> None:
    gateway, worker = _service("gateway"), _service("worker")
    assert gateway["depends_on"]["db"]["condition"] == "service_healthy"
    assert worker["depends_on"]["db"]["condition"] == "service_healthy"
    # The gateway applies migrations at start: workers wait until it is healthy.
    assert worker["depends_on"]["gateway"]["condition"] == "service_healthy"


def test_every_compose_service_env_is_accepted_by_settings() -> None:
    for name in ("gateway", "worker"):
        _settings_from(_environment(_service(name)))


# --- Dockerfile tests ----------------------------------------------------------------------------


def test_every_stage_is_python_3_11_slim() -> None:
    defaults = {}
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("ARG ") and "=" in line:
            key, _, value = line.removeprefix("ARG ").partition("=")
            defaults[key.strip()] = value.strip()
    for stage in _stages():
        image = stage[0].args.split()[0]
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), ""), image)
        assert image == "python:3.11-slim", stage[0].args


def test_image_serves_by_default_on_the_port_compose_maps() -> None:
    stage = _final_stage()
    (cmd,) = [i for i in stage if i.name == "CMD"]
    assert _exec_form(cmd.args) == ["memstrata", "serve"]
    exposed = {
        int(port.split("/")[0]) for i in stage if i.name == "EXPOSE" for port in i.args.split()
    }
    assert _gateway_port() in exposed
    env = _env(stage)
    assert env.get("MEMSTRATA_HOST") == "0.0.0.0"
    assert int(env.get("MEMSTRATA_PORT", Settings.model_fields["port"].default)) == _gateway_port()


def test_image_has_a_python_healthcheck_on_healthz() -> None:
    command = _healthcheck_command(_final_stage())
    assert command[0] in {"python", "python3"}, "slim images have no curl"
    assert "/healthz" in " ".join(command)


def test_image_does_not_run_as_root() -> None:
    users = [i.args.split(":")[0] for i in _final_stage() if i.name == "USER"]
    assert users, "the final stage never sets USER"
    assert users[-1] not in {"root", "0"}
    stage = _final_stage()
    last_user = max(n for n, i in enumerate(stage) if i.name == "USER")
    assert last_user < next(n for n, i in enumerate(stage) if i.name == "CMD")


def test_image_keeps_the_source_layout_and_installs_without_dev_extras() -> None:
    build_stages = [s for s in _stages() if set(IMAGE_SOURCES) <= set(_copy_targets(s))]
    assert build_stages, f"no stage copies all of {IMAGE_SOURCES}"
    stage = build_stages[0]
    targets = _copy_targets(stage)
    root = targets["alembic.ini"].parent
    for package in ("migrations", "gateway", "memory"):
        # memory/db.py finds alembic.ini beside the `memory` package; alembic.ini finds migrations/.
        assert targets[package] == root / package, targets
    assert targets["pyproject.toml"] == root / "pyproject.toml"
    installs = [i for i in stage if i.name == "RUN" and re.search(r"pip install[^&]*-e \.", i.args)]
    assert installs, "install the project editable, in place, so the layout holds"
    assert _workdir_of(stage, installs[0]) == root
    runs = " ".join(i.args for i in _instructions() if i.name == "RUN")
    assert "[dev" not in runs
    if stage is not _final_stage():
        copies = [shlex.split(i.args) for i in _final_stage() if i.name == "COPY"]
        assert any(c[0].startswith("--from") and c[1:] == [str(root), str(root)] for c in copies)


def test_dockerignore_keeps_local_state_out_but_not_the_sources() -> None:
    patterns = {
        line.strip().rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".memstrata", ".git"} <= patterns
    assert patterns & {"bench", "bench/results"}
    assert not patterns & set(IMAGE_SOURCES)


# --- Kubernetes tests ----------------------------------------------------------------------------


def test_manifests_parse_and_name_everything() -> None:
    names = {path.name for path in K8S.glob("*.yaml")}
    assert {"gateway.yaml", "worker.yaml", "secret.example.yaml"} <= names
    for name in names:
        for document in _manifests(name):
            assert document["apiVersion"] and document["kind"] and document["metadata"]["name"]
            assert "namespace" not in document["metadata"], name


def test_gateway_deployment_probes_replicas_resources_and_service() -> None:
    deployment = _one("gateway.yaml", "Deployment")
    assert deployment["spec"]["replicas"] == 2
    container = _main_container(deployment)
    assert _command(container.get("command")) + _command(container.get("args")) in (
        [],
        ["memstrata", "serve"],
    )
    ports = {port.get("name"): port["containerPort"] for port in container["ports"]}
    assert _gateway_port() in ports.values()
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        http = container[probe]["httpGet"]
        assert http["path"] == path, probe
        assert ports.get(http["port"], http["port"]) == _gateway_port(), probe
    assert container["resources"]["requests"] and container["resources"]["limits"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = _one("gateway.yaml", "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    (target,) = [port["targetPort"] for port in service["spec"]["ports"]]
    assert ports.get(target, target) == _gateway_port()


def test_gateway_deployment_env_and_secret() -> None:
    env = _k8s_env(_main_container(_one("gateway.yaml", "Deployment")))
    for key in ("MEMSTRATA_DATABASE_URL", "MEMSTRATA_UPSTREAM_API_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"]["name"] == "memstrata", key
    assert env["MEMSTRATA_WORKERS"]["value"] == "0"
    plain = {key: item["value"] for key, item in env.items() if "value" in item}
    settings = _settings_from(_env(_final_stage()) | plain)
    assert settings.workers == 0
    assert settings.host == "0.0.0.0"


def test_worker_deployment_runs_memstrata_worker_on_the_secret_database() -> None:
    deployment = _one("worker.yaml", "Deployment")
    container = _main_container(deployment)
    command = _command(container.get("command")) + _command(container.get("args"))
    assert command == ["memstrata", "worker"]
    env = _k8s_env(container)
    assert env["MEMSTRATA_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "memstrata"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The gateway's Service must not send HTTP traffic to worker pods.
    assert not _one("gateway.yaml", "Service")["spec"]["selector"].items() <= labels.items()


def test_example_secret_holds_every_key_the_deployments_read() -> None:
    secret = _one("secret.example.yaml", "Secret")
    assert secret["metadata"]["name"] == "memstrata"
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    for name in ("gateway.yaml", "worker.yaml"):
        for container in _containers(_one(name, "Deployment")):
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["name"] == "memstrata" and ref["key"] in keys, (name, item)


def test_pods_run_as_non_root() -> None:
    for name in ("gateway.yaml", "worker.yaml"):
        pod = _one(name, "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"].get("runAsUser", 1) != 0, name


# --- across files --------------------------------------------------------------------------------


def test_every_memstrata_variable_is_a_settings_field() -> None:
    used = [(where, key) for where, key in _all_env_keys() if key.startswith(ENV_PREFIX)]
    places = {where.split()[0] for where, _ in used}
    assert {"compose", "Dockerfile", "gateway.yaml", "worker.yaml"} <= places
    unknown = [
        f"{where}: {key}"
        for where, key in used
        if key.removeprefix(ENV_PREFIX).lower() not in Settings.model_fields
    ]
    assert not unknown, f"not fields of Settings: {unknown}"
