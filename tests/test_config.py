"""Job configuration: defaults, precedence, typing and every family of bad input.

Fast and pure: no Ray, no torch.  Run: python -m pytest tests/test_config.py -q
"""

import dataclasses
import pathlib
import pickle

import pytest
import yaml

from raytp import config
from raytp.config import ConfigError, JobConfig, from_dict, load

JOBS = pathlib.Path(__file__).resolve().parent.parent / "jobs"


def problems_of(d, overrides=(), source="jobs/x.yaml") -> list[str]:
    with pytest.raises(ConfigError) as info:
        from_dict(d, source=source, overrides=overrides)
    err = info.value
    assert str(err) == "\n".join(err.problems)
    return err.problems


def write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------
# Good input

def test_empty_dict_and_empty_file_give_the_defaults(tmp_path):
    assert from_dict({}) == JobConfig()
    assert from_dict(None) == JobConfig()
    assert load(write(tmp_path, "")) == JobConfig()
    cfg = JobConfig()
    assert (cfg.model.n_layer, cfg.parallel.tp, cfg.train.steps) == (4, 1, 200)
    assert cfg.model.init_from is None and cfg.runtime.device == "cpu"


def test_empty_section_means_defaults(tmp_path):
    assert load(write(tmp_path, "model:\ntrain:\n")) == JobConfig()


def test_override_beats_file_beats_default(tmp_path):
    path = write(tmp_path, "parallel: {tp: 2}\ntrain: {steps: 50, lr: 0.01}\n")
    cfg = load(path, overrides=["train.steps=70"])
    assert cfg.train.steps == 70        # override over file
    assert cfg.parallel.tp == 2         # file over default
    assert cfg.train.lr == 0.01         # file, not overridden
    assert cfg.train.batch_size == 16   # default
    assert load(path, ["train.steps=30", "train.steps=90"]).train.steps == 90  # last wins


def test_override_fixes_a_bad_file_value(tmp_path):
    path = write(tmp_path, "train: {lr: fast}\n")
    assert load(path, ["train.lr=0.002"]).train.lr == 0.002


@pytest.mark.parametrize("override, section, key, value", [
    ("parallel.tp=4", "parallel", "tp", 4),
    ("train.lr=3e-4", "train", "lr", 3e-4),           # YAML 1.1 reads this as a string
    ("train.lr=1", "train", "lr", 1.0),               # an int where a float is wanted
    ("parallel.sequence_parallel=true", "parallel", "sequence_parallel", True),
    ("model.init_from=null", "model", "init_from", None),
    ("model.init_from=/ckpt/gpt2", "model", "init_from", "/ckpt/gpt2"),
    ("train.micro_batch_size=4", "train", "micro_batch_size", 4),
    ("runtime.device=cuda", "runtime", "device", "cuda"),
    ("name=2024", None, "name", "2024"),              # a number given for a string
])
def test_overrides_are_typed_as_the_field(override, section, key, value):
    cfg = from_dict({"model": {"init_from": "x"}}, overrides=[override])
    got = getattr(getattr(cfg, section) if section else cfg, key)
    assert got == value and type(got) is type(value)


def test_float_in_file_written_without_a_dot_is_a_number(tmp_path):
    cfg = load(write(tmp_path, "train: {lr: 3e-4, min_lr: 0}\n"))
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.min_lr, float)


def test_derived_batch_sizes():
    cfg = from_dict({"parallel": {"tp": 2, "dp": 2},
                     "train": {"batch_size": 32, "micro_batch_size": 4}})
    assert (cfg.world_size, cfg.local_batch_size, cfg.micro_batch,
            cfg.grad_accum_steps) == (4, 16, 4, 4)
    cfg = from_dict({"parallel": {"dp": 2}, "train": {"batch_size": 32}})
    assert (cfg.micro_batch, cfg.grad_accum_steps) == (16, 1)


def test_vocab_need_not_divide_tp():
    assert from_dict({"parallel": {"tp": 4}, "model": {"vocab_size": 50257}})


def test_round_trip_through_dict_and_yaml():
    cfg = from_dict({"name": "r1", "parallel": {"tp": 2, "dp": 2},
                     "train": {"micro_batch_size": 2}, "model": {"init_from": "gpt2"},
                     "profile": {"steps": [3, 4], "ranks": [0, 3]}})
    d = cfg.to_dict()
    assert from_dict(d) == cfg
    assert from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg
    assert d["parallel"] == {"tp": 2, "pp": 1, "dp": 2, "pp_schedule": "1f1b", "pp_virtual": 1, "pp_layers": None,
                             "sequence_parallel": False, "zero": 0, "overlap_grad_reduce": True,
                             "tp_overlap": True, "overlap_param_gather": False, "ep": 1, "etp": None, "cp": 1,
                             "cp_attention": "ring", "min_dp": None, "max_dp": None}
    assert d["profile"] == {"steps": [3, 4], "ranks": [0, 3], "memory": False}


@pytest.mark.parametrize("path", sorted(JOBS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_job_file_validates(path):
    cfg = load(path)
    assert cfg.world_size == cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp * cfg.parallel.dp


def test_the_shipped_job_files_exist():
    names = {p.name for p in JOBS.glob("*.yaml")}
    assert {"default.yaml", "gpt2-tp4-dp2.yaml", "gpt2-medium-tp8.yaml"} <= names
    cfg = load(JOBS / "default.yaml")
    assert (cfg.parallel.tp, cfg.runtime.device, cfg.data.source) == (2, "cpu", "builtin")


def test_describe_covers_every_field():
    rows = config.describe()
    keys = [r[0] for r in rows]
    expected = ["name"] + [
        f"{sec.name}.{f.name}"
        for sec in dataclasses.fields(JobConfig) if sec.name != "name"
        for f in dataclasses.fields(getattr(JobConfig(), sec.name))]
    assert keys == expected
    assert all(len(r) == 4 and all(isinstance(x, str) and x for x in r) for r in rows)
    by_key = {r[0]: r for r in rows}
    assert by_key["parallel.tp"][1:3] == ("int", "1")
    assert by_key["model.init_from"][1:3] == ("str or null", "null")
    assert "Hugging Face" in by_key["model.init_from"][3]


# --------------------------------------------------------------------------
# Bad input: each family names the key and what would be valid

@pytest.mark.parametrize("d, overrides, expect", [
    ({"train": {"stepz": 1}}, (), ["jobs/x.yaml: train.stepz: unknown key",
                                   "did you mean steps", "valid keys in train: steps"]),
    ({"trian": {"steps": 1}}, (), ["trian: unknown key", "valid keys in the job file"]),
    ({}, ["model.n_layr=2"], ["--set model.n_layr: unknown key", "n_layer"]),
    ({}, ["nope.x=2"], ["--set nope.x: unknown key"]),
    ({}, ["parallel.tp"], ["--set parallel.tp: expected KEY=VALUE"]),
    ({}, ["model=3"], ["--set model: is a section", "e.g. model.n_layer"]),
    ({}, ["trian.steps=3"], ["--set trian.steps: unknown key (did you mean train?)"]),
    ({"model": 3}, (), ["jobs/x.yaml: model: expected a mapping"]),
], ids=["key", "section", "set-key", "set-section", "set-no-equals", "set-section-itself",
         "set-typo-section", "not-mapping"])
def test_unknown_or_malformed_keys(d, overrides, expect):
    text = "\n".join(problems_of(d, overrides))
    for piece in expect:
        assert piece in text


@pytest.mark.parametrize("d, overrides, key, expected", [
    ({}, ["train.lr=abc"], "--set train.lr", "expected a number, got 'abc'"),
    ({"train": {"lr": "abc"}}, (), "jobs/x.yaml: train.lr", "expected a number"),
    ({"train": {"steps": 1.5}}, (), "train.steps", "expected an integer"),
    ({"train": {"steps": True}}, (), "train.steps", "expected an integer, got true"),
    ({"train": {"steps": "10"}}, (), "train.steps", "expected an integer"),
    ({"model": {"dropout": False}}, (), "model.dropout", "expected a number"),
    ({"parallel": {"sequence_parallel": 1}}, (), "parallel.sequence_parallel",
     "expected true or false"),
    ({"data": {"source": 5}}, (), "data.source", "expected a string"),
    ({"data": {"source": None}}, (), "data.source", "expected a string, got null"),
    ({"train": {"steps": None}}, (), "train.steps", "got null"),
    ({"model": {"init_from": [1]}}, (), "model.init_from", "expected a string or null"),
])
def test_wrong_types(d, overrides, key, expected):
    (line,) = problems_of(d, overrides)
    assert line.startswith(key + ":") or line.startswith("jobs/x.yaml: " + key + ":")
    assert expected in line


@pytest.mark.parametrize("key, value", [
    ("model.n_layer", 0), ("model.n_head", -1), ("model.n_embd", 0),
    ("model.block_size", 0), ("model.vocab_size", 0),
    ("parallel.tp", 0), ("parallel.dp", 0),
    ("train.steps", 0), ("train.batch_size", 0), ("train.micro_batch_size", 0),
    ("model.dropout", 1.0), ("model.dropout", -0.1),
    ("train.lr", 0), ("train.min_lr", -1e-5), ("train.warmup_steps", -1),
    ("train.beta2", 1.0), ("train.grad_clip", -1), ("train.weight_decay", -0.1),
    ("train.eval_interval", -1), ("train.eval_steps", 0), ("train.steps_per_call", 0),
    ("checkpoint.every", -1), ("checkpoint.keep", 0),
    ("data.val_fraction", 0), ("data.val_fraction", 1),
    ("runtime.cpus_per_worker", 0), ("runtime.threads_per_worker", -1),
    ("runtime.placement_timeout_s", 0), ("runtime.step_timeout_s", -1),
    ("runtime.collective_timeout_s", 0),
])
def test_out_of_range(key, value):
    sec, leaf = key.split(".")
    (line,) = problems_of({sec: {leaf: value}})
    assert line.startswith(f"jobs/x.yaml: {key}: ") and "must be" in line


@pytest.mark.parametrize("key, value, valid", [
    ("runtime.device", "tpu", "cpu, cuda"),
    ("train.lr_schedule", "linear", "cosine, constant"),
])
def test_choices(key, value, valid):
    (line,) = problems_of({}, [f"{key}={value}"])
    assert line.startswith(f"--set {key}: ") and valid in line


@pytest.mark.parametrize("d, line", [
    ({"parallel": {"tp": 3}},
     "jobs/x.yaml: parallel.tp: 3 does not divide model.n_head=4; valid tp: 1, 2, 4"),
    ({"model": {"n_head": 5, "n_embd": 128}},
     "jobs/x.yaml: model.n_head: 5 does not divide model.n_embd=128; valid n_head: 1, 2, 4"),
    ({"train": {"min_lr": 0.01, "lr": 0.001}},
     "jobs/x.yaml: train.min_lr: 0.01 exceeds train.lr=0.001"),
    ({"train": {"batch_size": 10}, "parallel": {"dp": 4}},
     "jobs/x.yaml: train.batch_size: 10 is not divisible by parallel.dp=4"),
    ({"train": {"batch_size": 16, "micro_batch_size": 3}, "parallel": {"dp": 2}},
     "jobs/x.yaml: train.micro_batch_size: 3 does not divide the per-rank batch "
     "train.batch_size/parallel.dp=8; valid: 1, 2, 4, 8"),
    ({"parallel": {"tp": 4, "sequence_parallel": True}, "model": {"block_size": 130}},
     "jobs/x.yaml: parallel.sequence_parallel: needs model.block_size=130"),
    ({"name": "a/b"}, "jobs/x.yaml: name: 'a/b' is not a valid run name"),
    ({"parallel": {"dp": 2, "max_dp": 1}}, "jobs/x.yaml: parallel.max_dp: 1 is below parallel.dp=2"),
    ({"train": {"batch_size": 16}, "parallel": {"dp": 2, "max_dp": 3}},
     "jobs/x.yaml: parallel.max_dp: 3 does not divide train.batch_size=16"),
    ({"model": {"arch": "llama", "n_kv_head": 2, "moe": {"n_experts": 4, "top_k": 2, "moe_ffn": 16}},
      "parallel": {"ep": 2, "dp": 2, "max_dp": 3}, "train": {"batch_size": 12}},
     "jobs/x.yaml: parallel.ep: ep=2 x etp=1 must divide parallel.max_dp x parallel.tp = 3 (an elastic job grows "
     "only to a DP its experts fold over)"),
], ids=["tp-heads", "heads-embd", "min_lr", "dp-batch",
        "micro-batch", "sequence-parallel", "name", "max_dp-below", "max_dp-batch", "max_dp-experts"])
def test_cross_field_rules(d, line):
    (got,) = problems_of(d)
    assert got.startswith(line)


def test_problem_is_blamed_on_the_override_that_caused_it():
    (line,) = problems_of({"model": {"n_head": 4}}, ["parallel.tp=3"])
    assert line.startswith("--set parallel.tp: 3 does not divide model.n_head=4")


def test_a_failed_rule_does_not_cascade():
    # n_head=5 breaks n_embd % n_head; "tp=2 does not divide 5" follows from it.
    (line,) = problems_of({"parallel": {"tp": 2}}, ["model.n_head=5"])
    assert line.startswith("--set model.n_head: 5 does not divide model.n_embd=128")


def test_all_problems_are_reported_together():
    problems = problems_of(
        {"train": {"stepz": 1, "lr": "abc"}, "parallel": {"tp": 3},
         "runtime": {"device": "tpu"}, "checkpoint": {"keep": 0}},
        ["model.dropout=2", "oops"])
    text = "\n".join(problems)
    assert len(problems) == 7
    for key in ["train.stepz", "train.lr", "parallel.tp", "runtime.device",
                "checkpoint.keep", "model.dropout", "--set oops"]:
        assert key in text


def test_a_bad_value_is_reported_once_not_again_by_the_rules_that_use_it():
    # lr is unusable, so "min_lr exceeds lr" must not pile on.
    assert len(problems_of({"train": {"lr": "fast", "min_lr": 0.5}})) == 1
    assert len(problems_of({"train": {"lr": -1, "min_lr": 0.5}})) == 1


def test_missing_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load(path)
    (line,) = info.value.problems
    assert line.startswith(str(path)) and "cannot read" in line


def test_yaml_syntax_error_is_one_line_naming_the_file_and_line(tmp_path):
    path = write(tmp_path, "model:\n  n_layer: 4\n  n_head: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    (line,) = info.value.problems
    assert line.startswith(f"{path}:") and "invalid YAML" in line


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load(write(tmp_path, "- 1\n- 2\n"))


def test_yaml_tags_are_not_executed(tmp_path):
    path = write(tmp_path, "name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load(path)


def test_error_survives_pickling():
    err = ConfigError(["a: one", "b: two"])
    again = pickle.loads(pickle.dumps(err))
    assert again.problems == err.problems and str(again) == str(err)


def test_validate_rechecks_a_config_built_in_code():
    cfg = dataclasses.replace(JobConfig(), parallel=config.ParallelConfig(tp=3))
    with pytest.raises(ConfigError, match="parallel.tp: 3 does not divide"):
        config.validate(cfg, source="scale")


def test_a_warmup_longer_than_the_run_is_shortened_with_a_note():
    from raytp.config import adjusted
    cfg, notes = adjusted(from_dict({"train": {"warmup_steps": 20, "steps": 10}}))
    assert cfg.train.warmup_steps == 10 and len(notes) == 1
    assert "train.warmup_steps=20 exceeds train.steps=10" in notes[0]
    same, none = adjusted(from_dict({"train": {"warmup_steps": 5, "steps": 10}}))
    assert same.train.warmup_steps == 5 and none == []
