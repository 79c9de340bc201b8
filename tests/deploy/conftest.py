"""Helpers for the deployment tests: where the files are, YAML loading, and the real ``dflash2 serve``
parser that every command line in the Dockerfile, compose file and manifests must pass."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import yaml

from dflash2.cli import build_parser, engine_config_from_args
from server.metrics import metric_specs
from server.settings import ServerSettings, settings_from_args

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = REPO / "Dockerfile"
COMPOSE_DIR = DEPLOY / "compose"
KUBERNETES_DIR = DEPLOY / "kubernetes"
DASHBOARD = DEPLOY / "grafana" / "dflash2.json"
ADAPTER_VALUES = KUBERNETES_DIR / "adapter" / "prometheus-adapter-values.yaml"

# The image's entrypoint, which compose `command` and Kubernetes `args` are appended to.
ENTRYPOINT = ["dflash2", "serve", "--host", "0.0.0.0", "--port", "8000"]
SERVER_PORT = 8000
CACHE_DIR = "/cache"
# uvicorn's grace after the drain (server/app.py _SHUTDOWN_GRACE_SECONDS).
SHUTDOWN_GRACE_SECONDS = 3


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The real server's engine thread shares 2 cores with the test, Prometheus and the clients."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def load_yaml(path: pathlib.Path) -> list[Any]:
    """Every document of a YAML file (empty documents dropped)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def serve_settings(args: Sequence[str]) -> ServerSettings:
    """Parse ``dflash2 <args>`` with the real parser and build the server settings (fails like the CLI)."""
    parsed = build_parser().parse_args(list(args))
    assert parsed.command == "serve"
    return settings_from_args(parsed, engine_config_from_args(parsed))


def exported_series() -> set[str]:
    """Every series name ``/metrics`` exports under our prefix (counters with ``_total``, histograms with
    ``_bucket``, ``_sum`` and ``_count``)."""
    names: set[str] = set()
    for spec in metric_specs(block_size=8):
        base = "dflash2_" + spec.name
        if spec.kind == "counter":
            names.add(base + "_total")
        elif spec.kind == "histogram":
            names.update({base + "_bucket", base + "_sum", base + "_count"})
        else:
            names.add(base)
    return names


def exported_labels() -> set[str]:
    """Labels on our series, plus the ones Prometheus adds (``job``, ``instance``) and ``le``."""
    labels = {"model_name", "job", "instance", "le"}
    for spec in metric_specs(block_size=8):
        labels.update(spec.labels)
    return labels


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title and refId, PromQL) for every target of every panel, rows' nested panels included."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            queries.append((f"{panel['title']} [{target['refId']}]", target["expr"]))
    return queries


def dashboard_variables() -> dict[str, Any]:
    """The dashboard's template variables by name."""
    return {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}


def metric_names_in(expr: str) -> set[str]:
    """The ``dflash2_*`` / ``vllm:*`` metric names a PromQL expression reads."""
    return set(re.findall(r"\b(?:dflash2_|vllm:)[a-zA-Z0-9_:]+", expr))


def command_words(value: str | list[str]) -> list[str]:
    """A compose ``command`` (string or list) as words."""
    return shlex.split(value) if isinstance(value, str) else [str(word) for word in value]
