"""deploy/: the Kubernetes manifests are valid against Kubernetes' own schemas (kubernetes-validate,
offline), probe /health on the port pytgi listens on, stop gracefully, and the gauges docs/deploy.md
names for the Gateway API Inference Extension are what /metrics carries."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml

from pytgi.api.metrics import Metrics
from pytgi.core import protocol as P
from pytgi.core.config import ServerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def documents():
    return [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("name, doc", documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_each_manifest_is_valid_kubernetes(name, doc):
    kubernetes_validate.validate(doc, "1.33", strict=True)


def test_the_deployment_probes_health_and_stops_gracefully():
    docs = {doc["kind"]: doc for _, doc in documents()}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    port = container["ports"][0]["containerPort"]
    assert port == ServerConfig.__dataclass_fields__["port"].default
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    grace = ServerConfig.__dataclass_fields__["graceful_termination_timeout"].default
    assert pod["terminationGracePeriodSeconds"] > grace  # in-flight requests finish before SIGKILL
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]


def test_the_gauges_the_endpoint_picker_reads_are_exported():
    m = Metrics()
    m.model_info(SimpleNamespace(block_size=16, num_blocks=256), lambda: ["sql", "chat"])
    m.engine_stats(
        P.EngineStats(
            running=3,
            waiting=2,
            kv_cache_usage=0.25,
            prefix_cache_hit_rate=0.0,
            preemptions=0,
            failed_steps=0,
            waiting_adapters=["sql"],
        )
    )
    text = m.render().decode()
    assert "pytgi_num_requests_waiting 2.0" in text
    assert "pytgi_num_requests_running 3.0" in text
    assert "pytgi_kv_cache_usage_perc 0.25" in text
    assert 'waiting_lora_adapters="sql"' in text and 'running_lora_adapters="chat,sql"' in text
    assert 'pytgi_cache_config_info{block_size="16",num_gpu_blocks="256"} 1.0' in text
    documented = DOCS.read_text()
    for name in (
        "pytgi_num_requests_waiting",
        "pytgi_num_requests_running",
        "pytgi_kv_cache_usage_perc",
        "pytgi_lora_requests_info",
        "pytgi_cache_config_info",
    ):
        assert name in text and name in documented, name
