"""The files that take raytp to a real cluster: cluster.yaml passes Ray's own launcher validation,
and the Grafana dashboard reads every metric raytp exports."""
import copy
import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_yaml_passes_rays_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config = prepare_config(copy.deepcopy(raw))  # what `ray up` does before it validates
    validate_config(config)
    gpu = [t for t in config["available_node_types"].values() if t["node_config"].get("InstanceType") == "p4d.24xlarge"]
    assert len(gpu) == 1 and gpu[0]["min_workers"] < gpu[0]["max_workers"], "the autoscaler must be free to add/remove"
    assert config["head_node_type"] in config["available_node_types"]
    assert any("raytp" in cmd for cmd in config["setup_commands"]), "nodes must install raytp"


def test_cluster_validator_catches_a_bad_key():
    """The check above is not vacuous: Ray rejects an unknown key."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    raw["available_node_types"]["gpu8"]["min_workerz"] = 1
    try:
        validate_config(prepare_config(raw))
    except jsonschema.ValidationError as e:
        assert "min_workerz" in str(e)
    else:
        raise AssertionError("a misspelt key passed Ray's validation")


def test_grafana_dashboard_reads_every_raytp_metric():
    from raytp.runtime.driver.metrics import exported_names
    dash = json.loads((ROOT / "grafana" / "raytp.json").read_text())
    panels = dash["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    # Ray's Prometheus endpoint names an application metric raytp_x as ray_raytp_x.
    used = set(re.findall(r"\bray_(raytp_\w+)", " ".join(exprs)))
    missing = set(exported_names()) - used
    assert not missing, f"grafana/raytp.json shows none of {sorted(missing)}"
    unknown = used - set(exported_names())
    assert not unknown, f"it reads metrics raytp does not export: {sorted(unknown)}"
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert all('run=~"$run"' in e for e in exprs), "every query follows the run picker"
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "run"} <= names
