"""A real Prometheus (the ``prometheus`` binary; .ci/run installs the Debian package) scrapes the real
server every second while it serves chat and completion requests, streamed and not, with speculative
decoding on; then every PromQL expression of the Grafana dashboard, and the prometheus-adapter rule of
the HPA, must return data."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.conftest import (
    ADAPTER_VALUES,
    COMPOSE_DIR,
    dashboard_queries,
    dashboard_variables,
    load_yaml,
)
from tests.live_server import ServerThread, SmolLM2, scrape, wait_until

# What Grafana would substitute for its interval variables on a short time range.
RATE_WINDOW = "1m"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    """The prometheus binary on a free loopback port with a temporary config and storage."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        return data["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def real_server(smollm2: SmolLM2) -> Iterator[ServerThread]:
    """The embedded model with the default engine settings (adaptive speculation on, unlike the shared
    test server), so that every dashboard panel has data. The thread count stays fixed: Prometheus and
    the test's client share the cores, and a count changed mid-run leaves the step-cost table (measured
    at start-up) out of step, which could stop drafting and leave the acceptance panels empty."""
    engine = smollm2.engine(speculative_adaptive=True, adaptive_threads=False)
    with ServerThread(engine, max_concurrency=64) as server:
        yield server


@pytest.fixture
def prometheus(real_server: ServerThread, tmp_path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus binary is not on PATH: install it (apt-get install prometheus; .ci/run does)")
    # The compose scrape job, pointed at the test server and scraping every second.
    (config,) = load_yaml(COMPOSE_DIR / "prometheus.yml")
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    job["static_configs"] = [{"targets": [urllib.parse.urlsplit(real_server.url).netloc]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))

    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = Prometheus(f"http://127.0.0.1:{port}")

    def is_ready() -> bool:
        assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
        try:
            return httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(is_ready, timeout=30, interval=0.2)
        wait_until(lambda: server.value(f'up{{job="{job["job_name"]}"}} == 1') is not None, timeout=30, interval=0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def finish_reason(response: httpx.Response) -> str:
    return response.json()["choices"][0]["finish_reason"]


def stream_finish_reason(url: str, path: str, body: dict[str, Any]) -> str:
    reasons = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c.get("finish_reason")]
    assert len(reasons) == 1
    return reasons[0]


def serve_a_few_requests(url: str) -> list[str]:
    """Chat and completions, streamed and not; greedy, so the stop request stops on its stop string.

    The adaptive policy drafts only when its live timings say drafting pays, which on a busy host may be
    never; a seeded sampled request verifies the full block whatever the load (its text must not depend
    on the load), so the last request guarantees drafted steps for the acceptance panels."""
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}
    completion = {"prompt": "The three primary colours are", "temperature": 0}
    seeded = {"prompt": "Once upon a time", "temperature": 0.8, "seed": 1234, "max_tokens": 24}
    return [
        finish_reason(httpx.post(f"{url}/v1/completions", json=seeded, timeout=120)),
        finish_reason(httpx.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 6}, timeout=120)),
        stream_finish_reason(url, "/v1/chat/completions", {**chat, "max_tokens": 24, "stop": ["Paris"]}),
        finish_reason(httpx.post(f"{url}/v1/completions", json={**completion, "max_tokens": 6}, timeout=120)),
        stream_finish_reason(url, "/v1/completions", {**completion, "max_tokens": 6}),
    ]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Grafana's variables replaced as a dashboard would on a short range."""
    expr = expr.replace("$__rate_interval", RATE_WINDOW).replace("$__interval", RATE_WINDOW)
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def resolve_variables(prometheus: Prometheus) -> dict[str, str]:
    """Query variables (``label_values(metric, label)``) evaluated through the label API."""
    values = {}
    for name, variable in dashboard_variables().items():
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"]
        metric, label = query.removeprefix("label_values(").removesuffix(")").split(", ")
        found = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
        assert found, f"variable {name}: {query} found no values"
        values[name] = found[0]
    return values


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


def test_every_dashboard_query_returns_data(real_server: ServerThread, prometheus: Prometheus):
    reasons = serve_a_few_requests(real_server.url)
    assert sorted(set(reasons)) == ["length", "stop"], reasons

    # Wait until Prometheus holds the server's final counts, then for two more scrapes.
    generated = sum(v for (name, _), v in scrape(real_server.url).items() if name == "dflash2_generation_tokens_total")
    wait_until(lambda: prometheus.value("sum(dflash2_generation_tokens_total)") == generated, timeout=30, interval=0.2)
    time.sleep(2.5)

    variables = resolve_variables(prometheus)
    failures = []
    for title, expr in dashboard_queries():
        result = prometheus.query(substitute(expr, variables))
        if not has_data(result):
            failures.append(f"{title}: {expr} -> {result}")
    assert not failures, "dashboard queries without data:\n" + "\n".join(failures)

    # The HPA's metric as prometheus-adapter would query it (no pod labels outside Kubernetes: by instance).
    (rule,) = load_yaml(ADAPTER_VALUES)[0]["rules"]["custom"]
    adapter_query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", rule["name"]["as"])
        .replace("<<.LabelMatchers>>", 'job="dflash2"')
        .replace("<<.GroupBy>>", "instance")
    )
    assert has_data(prometheus.query(adapter_query)), adapter_query
