"""`rankmeter eval` imports only what evaluation needs (issue 23's start-up): none of the
service's dependencies (Kafka clients, Redis, Prometheus, YAML) and none of its own modules
beyond the command line, the TREC readers, the engine and the trec_eval layer. Checked in a
fresh interpreter, after a whole evaluation, with both kinds of measure names."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "trec_eval"
SERVICE_ONLY = ("kafka", "confluent_kafka", "redis", "hiredis", "prometheus_client", "yaml")
ALLOWED = {"rankmeter", "rankmeter.cli", "rankmeter.cli.command", "rankmeter.cli.common", "rankmeter.cli.evaluate",
           "rankmeter.redaction", "rankmeter.trec", "rankmeter._treader", "rankmeter.offline", "rankmeter.trec_eval",
           "rankmeter.trec_eval.names", "rankmeter.trec_eval.report"}
PROBE = """
import contextlib, io, json, sys
from rankmeter.cli.command import main
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(["eval", *sys.argv[1:]])
print(json.dumps({"rc": rc, "modules": sorted(sys.modules)}))
"""


@pytest.mark.parametrize("measures", [["-m", "all_trec", "-q"], ["-m", "nDCG@10", "--format", "json"]])
def test_eval_imports_none_of_the_service(measures):
    got = subprocess.run([sys.executable, "-c", PROBE, *measures, str(FIXTURES / "qrels.test"),
                          str(FIXTURES / "results.test")], capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(got.stdout)
    assert result["rc"] == 0
    modules = set(result["modules"])
    assert not {m for m in modules if m.split(".")[0] in SERVICE_ONLY}
    ours = {m for m in modules if m.split(".")[0] == "rankmeter" and not m.startswith("rankmeter.engine")}
    assert ours <= ALLOWED, ours - ALLOWED
