"""docker-compose.yml, the Dockerfile and monitoring/: their structure, and the compose
commands really serving a chat completion.

No Docker engine is needed: the slow test runs each pagedserve container's command and
environment as a local process (REDIS_URL pointed at the local Redis, a fresh prefix, the
api on a free local port, a float32 worker with a small pool), then runs each container's
healthcheck command, serves one real chat completion through that stack, and checks that
every metric the Grafana dashboard plots is in the api's /metrics. The Redis container's
command runs as a local redis-server too, and writes its append-only file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest
import redis
import yaml

from pagedserve.services.launcher.supervisor import Child, Supervisor
from tests.cli.helpers import REDIS_URL, REPO, START_TIMEOUT_S, base_env, chat_once, free_port, pagedserve_argv, ready
from tests.waiting import wait_for

COMPOSE = REPO / "docker-compose.yml"
DASHBOARD = REPO / "monitoring/grafana/dashboards/pagedserve.json"
BACKEND = ("kvstore", "scheduler", "gpu_worker")
SUBCOMMAND = {"kvstore": "kvstore", "scheduler": "scheduler", "gpu_worker": "worker", "gpu_worker_cuda": "worker",
              "api": "api"}


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} and ${VAR}, from this environment."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), value)


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_structure(services):
    assert set(services) == {"redis", *SUBCOMMAND, "proxy", "prometheus", "grafana"}
    assert not any("container_name" in svc for svc in services.values())  # every service scales
    assert services["redis"]["image"].startswith("redis:7")
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    redis_command = services["redis"]["command"]
    assert _option(redis_command, "--appendonly") == "yes" and _option(redis_command, "--appendfsync") == "everysec"
    assert services["redis"]["volumes"] == ["redis-data:/data"]
    for name, sub in SUBCOMMAND.items():
        svc = services[name]
        assert svc["command"][:2] == ["pagedserve", sub], name
        assert svc["environment"]["REDIS_URL"] == "redis://redis:6379/0", name
        assert "PAGEDSERVE_PREFIX" in svc["environment"], name
        assert svc["depends_on"]["redis"] == {"condition": "service_healthy"}, name
        for dep, cond in svc["depends_on"].items():
            assert cond["condition"] == "service_healthy" and "healthcheck" in services[dep], (name, dep)
        assert svc["healthcheck"]["test"][:4] == ["CMD", "pagedserve", "healthcheck", sub], name
    assert services["api"]["expose"] == ["8000"] and "ports" not in services["api"]  # replicas behind the proxy
    proxy = services["proxy"]
    assert proxy["ports"] == ["8000:8000"] and proxy["depends_on"]["api"] == {"condition": "service_healthy"}
    [mount] = proxy["volumes"]
    conf = (REPO / mount.split(":")[0]).read_text()
    assert mount.split(":")[1] == "/etc/nginx/conf.d/default.conf"
    assert "listen 8000;" in conf and "set $api http://api:8000;" in conf and "proxy_buffering off;" in conf
    assert "resolver 127.0.0.11" in conf and "proxy_set_header Upgrade $http_upgrade;" in conf  # DNS per replica; WS
    assert services["api"]["command"][services["api"]["command"].index("--host") + 1] == "0.0.0.0"
    gpu = services["gpu_worker_cuda"]
    assert gpu["profiles"] == ["gpu"] and "--device" in gpu["command"] and "cuda" in gpu["command"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert "profiles" not in services["gpu_worker"]  # the CPU worker is the default
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"] and "healthcheck" in services[name], name


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_monitoring_files_fit_together(services):
    prometheus = yaml.safe_load((REPO / "monitoring/prometheus.yml").read_text())
    [job] = prometheus["scrape_configs"]
    [dns] = job["dns_sd_configs"]  # each api replica scraped by its own address
    assert job["metrics_path"] == "/metrics" and dns == {"names": ["api"], "type": "A", "port": 8000}
    mounts = {m.split(":")[0]: m.split(":")[1] for m in services["prometheus"]["volumes"] + services["grafana"]["volumes"]}
    assert mounts["./monitoring/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    provisioning = REPO / "monitoring/grafana/provisioning"
    [source] = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((provisioning / "dashboards/pagedserve.yml").read_text())["providers"]
    assert mounts["./monitoring/grafana/dashboards"] == provider["options"]["path"]
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len(panels) >= 10
    for panel in panels:
        assert panel["datasource"]["uid"] == source["uid"] and panel["targets"], panel["title"]


def _dashboard_metrics() -> set[str]:
    """Every pagedserve: series a Grafana panel queries (histograms by their _bucket)."""
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    return set(re.findall(r"pagedserve:[a-z0-9_]+", " ".join(exprs)))


def test_dockerfile_builds_kernels_with_a_compiler_and_runs_as_a_user():
    text = (REPO / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert [stage.split("\n", 1)[0].split()[-1] for stage in stages] == ["build", "runtime"]
    build, runtime = stages
    assert "g++" in build and "pagedserve build-kernels" in build
    assert "COPY --from=build" in runtime and "/var/cache/pagedserve" in runtime
    users = re.findall(r"^USER (\S+)", runtime, flags=re.M)
    assert users and users[-1] not in ("root", "0")
    for stage in stages:  # the kernels are looked for where they were built
        assert "TORCH_EXTENSIONS_DIR=/var/cache/pagedserve/torch_extensions" in stage


def test_the_cpu_image_installs_no_triton_and_the_gpu_image_does(services):
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG GPU=0$", text, flags=re.M)
    (install,) = [run for run in re.findall(r"^RUN (.*?)(?<!\\)$", text, flags=re.M | re.S) if "GPU" in run]
    gpu, cpu = re.fullmatch(r'if \[ "\$GPU" = 1 \]; then (.*?); \\\s+else (.*?); fi.*', install, flags=re.S).groups()
    assert gpu == 'pip install ".[nvidia]"'
    assert "cpu_requirements.py > /tmp/requirements.txt" in cpu and "pip install --no-deps ." in cpu
    for args in ([], ["--no-deps"]):
        out = subprocess.run([sys.executable, str(REPO / "scripts/cpu_requirements.py"), *args], capture_output=True,
                             text=True, check=True).stdout
        assert "triton" not in out and "nvidia" not in out
    assert services["gpu_worker_cuda"]["build"]["args"]["GPU"] == "1"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary to run the command with")
def test_compose_redis_command_persists(services, tmp_path):
    command = services["redis"]["command"]
    port = free_port()
    proc = subprocess.Popen([shutil.which(command[0]), *command[1:], "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, socket_connect_timeout=1)
    try:
        def up() -> bool:
            try:
                return client.ping()
            except redis.ConnectionError:
                return False

        wait_for(up, 30, "redis-server with the compose command")
        client.set("k", "v")
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        wait_for(lambda: any(p.stat().st_size > 0 for p in tmp_path.rglob("*.aof")), 30, "the append-only file")
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)


def _local_argv(services: dict, name: str, extra: list[str]) -> list[str]:
    command = services[name]["command"]
    return [*pagedserve_argv(), *command[1:], *extra]


def _local_env(services: dict, name: str, prefix: str) -> dict[str, str]:
    env = {k: _interpolate(str(v)) for k, v in services[name]["environment"].items()}
    return base_env(**{**env, "REDIS_URL": REDIS_URL, "PAGEDSERVE_PREFIX": prefix})


@pytest.mark.slow
def test_compose_commands_serve_a_chat_completion(services, prefix):
    port = free_port()
    overrides = {"gpu_worker": ["--dtype", "float32", "--num-blocks", "256"],
                 "api": ["--host", "127.0.0.1", "--port", str(port)]}
    sup = Supervisor()
    try:
        for name in (*BACKEND, "api"):
            sup.start(Child(name, _local_argv(services, name, overrides.get(name, [])),
                            _local_env(services, name, prefix), forward=False))
        base_url = f"http://127.0.0.1:{port}"

        def stack_ready() -> bool:
            dead = sup.first_dead()
            assert dead is None, f"{dead.name} exited {dead.returncode()}:\n" + "\n".join(dead.tail())
            return ready(base_url)

        wait_for(stack_ready, START_TIMEOUT_S, "GET /ready == 200")
        for name in (*BACKEND, "api"):
            test = services[name]["healthcheck"]["test"]
            check = [*pagedserve_argv(), *test[2:]]
            if name == "api":
                check[-1] = base_url + "/health"
            out = subprocess.run(check, env=_local_env(services, name, prefix), cwd=REPO, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, (name, out.stdout, out.stderr)
        assert chat_once(base_url)
        bad = httpx.post(base_url + "/v1/completions", json={"model": "smollm2", "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400  # so the rejected-requests series has a sample
        text = httpx.get(base_url + "/metrics", timeout=10).text
        scraped = set(re.findall(r"^(pagedserve:[a-z0-9_]+?)(?:_bucket|_sum|_count)?(?:\{| )", text, flags=re.M))
        names = {re.sub(r"_bucket$", "", name) for name in _dashboard_metrics()}
        assert names <= scraped, f"plotted by Grafana, not in /metrics: {sorted(names - scraped)}"
        assert re.search(r'^pagedserve:kv_cache_usage_perc\{worker="[^"]+"\} ', text, flags=re.M)  # per-worker panels
        assert httpx.get(base_url + "/dashboard", timeout=10).status_code == 200
    finally:
        sup.stop_all(grace_s=20.0)
    for child in sup.children:  # SIGTERM is a clean stop: exit 0
        assert child.returncode() == 0, (child.name, child.returncode(), child.tail())
