"""Shared fixtures (shared helpers are in helpers.py). Ray clusters made here bind to loopback and are
shut down in teardown."""
import os

# Read by Ray at import: makes every node the tests start use 127.0.0.1 (name notwithstanding).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
from ray_head import TEST_RAY_ENV  # noqa: E402  (the Ray processes the tests start: no metrics)

for _k, _v in TEST_RAY_ENV.items():
    os.environ.setdefault(_k, _v)

import pytest  # noqa: E402


_shared_ray = []  # [True] while ray_local's Ray is up

# The longest files, longest first (serial seconds of a clean clone's run, 2026-12-07): the tests run in two
# processes that each take whole files in collection order (pyproject's addopts), so these start first and the
# suite ends on short files instead of one process running a long file alone. Every other file follows in name
# order.
LONG_FIRST = ["test_node_loss.py", "test_random_faults.py", "test_resize.py", "test_context_parallel_runs.py",
              "test_detached_runs.py", "test_cluster_jobs.py", "test_node_loss_experts.py", "test_moe_ep_runtime.py",
              "test_recovery.py", "test_node_loss_pipeline.py", "test_pipeline_runtime.py", "test_cli.py",
              "test_zero_runtime.py", "test_s3.py", "test_moe_runtime.py", "test_pipeline.py",
              "test_context_parallel_training.py", "test_checkpoint.py", "test_step_records.py", "test_chat_runs.py",
              "test_resize_state.py", "test_placement.py", "test_llama_runtime.py", "test_moe_zero_experts.py"]


def pytest_collection_modifyitems(config, items):
    """Files that start a Ray of their own (a fixture of theirs asks for `no_shared_ray`) come first, longest
    first, then every other file, longest first: a test process ends the Ray it shares with later files only
    in its first files, so it starts that Ray once, not again after each such file (a start and a shutdown
    cost ~6 s of CPU)."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    own = {item.path.name for item in items if "no_shared_ray" in item.fixturenames}
    items.sort(key=lambda item: (item.path.name not in own, rank.get(item.path.name, len(LONG_FIRST))))  # stable


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance with 4 CPUs (enough for TP=2 x DP=2). The first module that asks starts it and
    later modules that ask share it (a start and a shutdown cost ~5 s each), so a module leaves no actor or
    placement group of its own behind. It ends at the end of the session, or before a module starts a Ray of
    its own in this process: that module's fixture asks for `no_shared_ray`."""
    import ray
    if not _shared_ray:
        ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="raytp",
                 log_to_driver=False)
        _shared_ray.append(True)
    return ray


def _end_shared_ray():
    if _shared_ray:
        import ray
        ray.shutdown()
        _shared_ray.clear()


@pytest.fixture(scope="module")
def no_shared_ray():
    """Asked for by a fixture that starts its own Ray in this process: ends ray_local's first."""
    _end_shared_ray()


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_ends_with_the_session():
    yield
    _end_shared_ray()


# Runtime keys that choose where workers run, not what they compute (runtime.device is cpu): not part of
# what makes two reference runs the same.
PLACEMENT_KEYS = ("gpus_per_worker", "cpus_per_worker")


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """shared_run(key, cfg) -> the run dir of an unbroken run of job `cfg`, run once per suite run: the first
    test process that asks runs it while the other waits on a file lock, and both read the same directory (the
    test processes share the parent of their temp dirs). It runs in forked ranks without Ray (reference_runs: bit
    for bit a Ray run's, with no worker start). `key` names it; the config's hash, placement keys left out, makes
    sure one key never means two jobs."""
    import hashlib
    import json
    import shutil

    from filelock import FileLock
    from reference_runs import unbroken_run

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    root.mkdir(exist_ok=True)

    def get(key, cfg):
        d = cfg.to_dict()
        d["runtime"] = {k: v for k, v in d["runtime"].items() if k not in PLACEMENT_KEYS}
        digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]
        where = root / f"{key}-{digest}"
        with FileLock(str(where) + ".lock"):
            if not (where / "done").exists():
                shutil.rmtree(where, ignore_errors=True)  # a run that failed midway in the other process
                where.mkdir()
                unbroken_run(cfg, where / "run", key.replace("-", ""))
                (where / "done").write_text("")
        return where / "run"
    return get


@pytest.fixture(scope="session")
def recovery_reference(shared_run):
    """reference(tp, dp, **runtime): the final state of an uninterrupted helpers.recovery_job(tp, dp) run
    (``reference.run_dir(tp, dp)``: its run dir), run once per suite run (shared_run). `runtime` placement
    keys (gpus_per_worker) choose where the workers run, not what they compute, so they are not part of
    what is shared."""
    from helpers import final_state, recovery_job
    done, dirs = {}, {}

    def final(tp, dp, **runtime):
        if (tp, dp) not in done:
            dirs[(tp, dp)] = shared_run(f"ref-tp{tp}-dp{dp}", recovery_job(tp, dp, **runtime))
            done[(tp, dp)] = final_state(dirs[(tp, dp)])
        return done[(tp, dp)]

    def run_dir(tp, dp):
        """The run dir of that reference run (its metrics.jsonl, events.jsonl)."""
        final(tp, dp)
        return dirs[(tp, dp)]
    final.run_dir = run_dir
    return final


@pytest.fixture(scope="module")
def head():
    """A real `ray start` head for the module (tests/ray_head.py), ended with it."""
    from ray_head import start_head
    yield from start_head()
