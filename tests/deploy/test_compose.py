"""docker-compose.yml, the Prometheus scrape config and Grafana provisioning parse and point at each other:
the server's port and cache volume, Prometheus at the server's /metrics, Grafana at Prometheus and at the
dashboard file. The dashboard reads only series and labels that server/metrics.py exports."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

from tests.deploy.conftest import (
    CACHE_DIR,
    COMPOSE_DIR,
    DASHBOARD,
    ENTRYPOINT,
    REPO,
    SERVER_PORT,
    SHUTDOWN_GRACE_SECONDS,
    command_words,
    dashboard_queries,
    dashboard_variables,
    exported_labels,
    exported_series,
    load_yaml,
    metric_names_in,
    serve_settings,
)

PROMETHEUS_PORT = 9090


def compose() -> dict[str, Any]:
    (doc,) = load_yaml(COMPOSE_DIR / "docker-compose.yml")
    return doc


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def mounts(name: str) -> dict[str, pathlib.Path | str]:
    """Container path → host path (bind mounts, resolved from the compose folder) or volume name."""
    found: dict[str, pathlib.Path | str] = {}
    for volume in service(name).get("volumes", []):
        source, target = volume.split(":")[:2]
        found[target] = (COMPOSE_DIR / source).resolve() if source.startswith(".") else source
    return found


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, duration
    return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


def test_server_service_builds_the_repository_image():
    server = service("dflash2")
    assert (COMPOSE_DIR / server["build"]["context"]).resolve() == REPO
    assert (REPO / server["build"]["dockerfile"]).is_file()
    assert any(port.endswith(f":{SERVER_PORT}:{SERVER_PORT}") for port in server["ports"])
    assert mounts("dflash2")[CACHE_DIR] in compose()["volumes"]
    assert "DFLASH2_API_KEY" in server["environment"]
    assert "${DFLASH2_API_KEY" in server["environment"]["DFLASH2_API_KEY"]


def test_server_command_uses_real_flags_and_stops_after_the_drain():
    settings = serve_settings([*ENTRYPOINT[1:], *command_words(service("dflash2")["command"])])
    assert seconds(service("dflash2")["stop_grace_period"]) > settings.drain_timeout + SHUTDOWN_GRACE_SECONDS


def test_prometheus_scrapes_the_server_metrics():
    config_path = mounts("prometheus")["/etc/prometheus/prometheus.yml"]
    assert config_path == COMPOSE_DIR / "prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in service("prometheus")["command"]
    (config,) = load_yaml(COMPOSE_DIR / "prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "dflash2"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (static,) = job["static_configs"]
    assert static["targets"] == [f"dflash2:{SERVER_PORT}"]  # compose service name : container port


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard():
    grafana_mounts = mounts("grafana")
    provisioning = grafana_mounts["/etc/grafana/provisioning"]
    assert isinstance(provisioning, pathlib.Path) and provisioning.is_dir()

    (datasources,) = load_yaml(provisioning / "datasources" / "prometheus.yml")
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == f"http://prometheus:{PROMETHEUS_PORT}"
    assert any(port.endswith(f":{PROMETHEUS_PORT}") for port in service("prometheus")["ports"])

    (dashboards,) = load_yaml(provisioning / "dashboards" / "dflash2.yml")
    (provider,) = dashboards["providers"]
    container_path = provider["options"]["path"]
    assert grafana_mounts[container_path] == DASHBOARD.parent
    home = service("grafana")["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{container_path}/{DASHBOARD.name}"


def test_dashboard_uses_the_datasource_variable_everywhere():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = dashboard_variables()
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_reads_only_exported_series_and_labels():
    series, labels = exported_series(), exported_labels()
    queries = dashboard_queries()
    assert len(queries) >= 15
    for title, expr in queries:
        names = metric_names_in(expr)
        assert names, f"{title}: reads no dflash2 metric"
        assert names <= series, f"{title}: {names - series} not exported"
        for group in re.findall(r"\b(?:by|ignoring|on)\s*\(([^)]*)\)", expr):
            used = {label.strip() for label in group.split(",") if label.strip()}
            assert used <= labels, f"{title}: labels {used - labels} not exported"
    query = dashboard_variables()["model_name"]["query"]["query"]
    assert metric_names_in(query) <= series


def test_dashboard_covers_the_headline_panels():
    exprs = "\n".join(expr for _, expr in dashboard_queries())
    for needed in (
        "dflash2_spec_decode_num_accepted_tokens_per_pos_total",
        "dflash2_spec_decode_num_draft_tokens_total",
        "dflash2_generation_tokens_total",
        "dflash2_time_to_first_token_seconds_bucket",
        "dflash2_inter_token_latency_seconds_bucket",
        "dflash2_num_requests_running",
        "dflash2_num_requests_waiting",
        "dflash2_kv_cache_usage_perc",
        "dflash2_request_success_total",
        "dflash2_cpu_threads",
    ):
        assert needed in exprs, needed
    assert "histogram_quantile" in exprs
