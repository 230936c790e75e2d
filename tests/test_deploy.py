"""docker-compose.yml, the Dockerfile, the Kubernetes manifests and the Grafana files,
checked as far as a machine without Docker or Kubernetes allows: they parse, their
names, ports and paths agree with each other and with the code, generated files are up
to date."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import yaml

from rankmeter import config

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


k8s_rules = _script("k8s_rules")
dashboards_script = _script("dashboards")
K8S = ROOT / "deploy" / "k8s"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# ---- docker compose --------------------------------------------------------------

def test_compose_services_ports_and_mounts():
    compose = load(ROOT / "docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"kafka", "redis", "rankmeter", "simulator", "prometheus", "grafana"}
    for name, service in services.items():
        if service.get("image", "").startswith("rankmeter:"):
            assert service.get("build") == ".", f"{name} would try to pull the rankmeter image"
        for dependency in service.get("depends_on", []):
            assert dependency in services, (name, dependency)
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), (name, source)
    env = services["rankmeter"]["environment"]
    host, port = env["RANKMETER_KAFKA_BOOTSTRAP_SERVERS"].split(":")
    assert host == "kafka" and f"PLAINTEXT://kafka:{port}" in services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert env["RANKMETER_REDIS_URL"].startswith("redis://redis:6379")
    settings = config.load(None, {k: str(v) for k, v in env.items()})  # the service's settings are valid
    assert f"{settings.metrics.port}:{settings.metrics.port}" in services["rankmeter"]["ports"]
    # Prometheus scrapes rankmeter where it listens, and loads the rules it mounts.
    prometheus = load(ROOT / "deploy/prometheus/prometheus.yml")
    targets = [t for job in prometheus["scrape_configs"] if job["job_name"] == "rankmeter"
               for c in job["static_configs"] for t in c["targets"]]
    assert targets == [f"rankmeter:{settings.metrics.port}"]
    mounted = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert set(prometheus["rule_files"]) <= mounted
    # Grafana gets the provisioning and the dashboards the provider points at.
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert grafana_mounts["./dashboards"] == load(
        ROOT / "deploy/grafana/provisioning/dashboards/rankmeter.yaml")["providers"][0]["options"]["path"]
    datasource = load(ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and datasource["type"] == "prometheus"
    # The simulator's command line is one `rankmeter simulate` accepts.
    from rankmeter.cli import parser
    args = parser().parse_args(services["simulator"]["command"])
    assert args.command == "simulate" and args.rate > 0


def test_dockerfile_copies_what_exists_and_runs_the_cli():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:  # (a build stage's output: not the tree's)
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (ROOT / source).exists(), source
    assert 'ENTRYPOINT ["rankmeter"]' in dockerfile
    assert "EXPOSE 9108" in dockerfile
    assert re.search(r"^USER ", dockerfile, re.M)


# ---- Kubernetes ------------------------------------------------------------------

def test_kustomization_resources_and_labels():
    kustomization = load(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (K8S / resource).exists(), resource
    for generator in kustomization["configMapGenerator"]:
        for file in generator["files"]:
            assert (K8S / file).exists(), file
    deployment = load(K8S / "deployment.yaml")
    service = load(K8S / "service.yaml")
    podmonitor = load(K8S / "podmonitor.yaml")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (deployment["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     podmonitor["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    assert podmonitor["spec"]["podMetricsEndpoints"][0]["port"] in port_names
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert deployment["spec"]["replicas"] >= 2


def test_k8s_config_is_valid_and_matches_the_ports():
    deployment = load(K8S / "deployment.yaml")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    mount = container["volumeMounts"][0]["mountPath"]
    config_arg = container["args"][container["args"].index("--config") + 1]
    assert config_arg == f"{mount}/rankmeter.yaml"
    settings = config.load(str(K8S / "rankmeter.yaml"), {})
    assert container["ports"][0]["containerPort"] == settings.metrics.port
    from rankmeter.cli import parser
    assert parser().parse_args(container["args"]).command == "serve"


def test_prometheusrule_is_generated_from_the_rule_file():
    rule = load(K8S / "prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == load(ROOT / "deploy/prometheus/rules.yml")["groups"]
    assert (K8S / "prometheusrule.yaml").read_text() == k8s_rules.render(), \
        "deploy/k8s/prometheusrule.yaml is stale: run scripts/k8s_rules.py"


# ---- Grafana dashboards ----------------------------------------------------------

def dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))}


def test_dashboards_are_generated_and_well_formed():
    for name, text in dashboards_script.render().items():
        assert (ROOT / "dashboards" / name).read_text() == text, f"dashboards/{name} is stale: run scripts/dashboards.py"
    boards = dashboards()
    assert set(boards) == {"rankmeter-overview", "rankmeter-ab", "rankmeter-operations"}
    for name, board in boards.items():
        variables = {v["name"] for v in board["templating"]["list"]}
        assert "datasource" in variables
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        for panel in board["panels"]:
            assert panel["targets"] or panel["type"] == "text", (name, panel["title"])
            for target in panel["targets"]:
                used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
                assert used <= variables, (name, panel["title"], used - variables)
                assert target["datasource"]["uid"] == "${datasource}"
    overview_vars = {v["name"] for v in boards["rankmeter-overview"]["templating"]["list"]}
    assert {"ranker", "window"} <= overview_vars


def test_quality_panels_divide_sums_so_replicas_combine():
    for name, board in dashboards().items():
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                if "rankmeter_quality_numerator" in expr:
                    assert "sum by" in expr and "rankmeter_quality_denominator" in expr, (name, panel["title"])
                assert "rankmeter_quality{" not in expr, "averaging per-replica values is not exact"


def test_ab_dashboard_reads_the_always_valid_statistics():
    """No fixed-horizon interval computed in PromQL (it is wrong under continuous
    monitoring): every A/B panel reads the series the service exports."""
    board = dashboards()["rankmeter-ab"]
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert not any("rankmeter_quality" in e or "1.96" in e for e in exprs)
    for name in ("delta", "ci_lower", "ci_upper", "p_value", "queries", "judged_share", "srm_p_value", "decision"):
        assert any(f"rankmeter_ab_{name}{{" in e for e in exprs), name
    assert any(p["type"] == "text" for p in board["panels"])
