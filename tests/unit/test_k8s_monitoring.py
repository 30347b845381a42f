"""Kubernetes monitoring manifests: the PodMonitor finds every Ray pod of the RayService
on its metrics port; the PrometheusRule and the Grafana dashboard ConfigMap are what
`python -m cluster.k8s_monitoring` renders from the rules file and the dashboard generator.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from cluster import k8s_monitoring as k8s
from cluster.grafana import dashboard

ROOT = Path(__file__).resolve().parents[2]
PODMONITOR = ROOT / "cluster" / "prometheus" / "podmonitor.yaml"
KUBERAY = ROOT / "cluster" / "kuberay-rayservice.yaml"
KUBECTL_APPLY_ANNOTATION_LIMIT = 262144  # bytes: client-side `kubectl apply` keeps the whole object there
REGENERATE = "regenerate: python -m cluster.k8s_monitoring"


def _ray_pods() -> list[tuple[dict, dict]]:
    """(pod template, rayStartParams) for the head and every worker group of the RayService."""
    cluster = yaml.safe_load(KUBERAY.read_text())["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [(g["template"], g["rayStartParams"]) for g in groups]


def test_podmonitor_selects_every_ray_pod_on_its_metrics_port() -> None:
    doc = yaml.safe_load(PODMONITOR.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PodMonitor"
    assert doc["metadata"]["labels"]["release"] == k8s.RELEASE_LABEL["release"]
    selector = doc["spec"]["selector"]["matchLabels"]
    assert selector and set(doc["spec"]["selector"]) == {"matchLabels"}
    (endpoint,) = doc["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    pods = _ray_pods()
    assert len(pods) == 4  # head + router, target, draft groups
    for template, params in pods:
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items(), labels
        ray_container = template["spec"]["containers"][0]  # KubeRay: the Ray container comes first
        ports = {p["name"]: p["containerPort"] for p in ray_container["ports"]}
        assert ports[endpoint["port"]] == int(params["metrics-export-port"])
    assert doc["spec"]["jobLabel"] in selector
    targets = {r["targetLabel"] for r in endpoint["relabelings"]}
    assert {"ray_io_cluster", "ray_io_node_type", "ray_io_group"} <= targets


def test_prometheus_rule_is_the_rules_file() -> None:
    committed = k8s.PROMETHEUS_RULE.read_text()
    assert committed == k8s.render_prometheus_rule(), REGENERATE
    doc = yaml.safe_load(committed)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert doc["spec"]["groups"] == yaml.safe_load(k8s.RULES.read_text())["groups"]
    assert doc["metadata"]["labels"]["release"] == k8s.RELEASE_LABEL["release"]


def test_dashboard_configmap_matches_the_dashboard_json() -> None:
    committed = k8s.DASHBOARD_CONFIGMAP.read_text()
    assert committed == k8s.render_dashboard_configmap(), REGENERATE
    doc = yaml.safe_load(committed)
    assert doc["apiVersion"] == "v1" and doc["kind"] == "ConfigMap"
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"  # a string, as Kubernetes labels are
    (key,) = doc["data"]
    assert key.endswith(".json")
    text = doc["data"][key]
    assert text == (ROOT / "cluster" / "grafana" / "specserve.json").read_text() == dashboard.render()
    assert json.loads(text)["uid"] == dashboard.DASHBOARD_UID
    assert len(committed.encode()) < KUBECTL_APPLY_ANNOTATION_LIMIT


def test_cli_writes_both(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(k8s, "PROMETHEUS_RULE", tmp_path / "prometheusrule.yaml")
    monkeypatch.setattr(k8s, "DASHBOARD_CONFIGMAP", tmp_path / "dashboard-configmap.yaml")
    monkeypatch.setattr(k8s, "ROOT", tmp_path / "cluster")
    (tmp_path / "cluster").mkdir()
    assert k8s.main([]) == 0
    assert (tmp_path / "prometheusrule.yaml").read_text() == k8s.render_prometheus_rule()
    assert (tmp_path / "dashboard-configmap.yaml").read_text() == k8s.render_dashboard_configmap()
