"""What the tests share: small jobs, driving a Driver, reading a run dir, Ray's view of the actors.

Fixtures live in conftest.py; everything a test module imports lives here, in offline.py (states,
checkpoints and datasets made without Ray), in tp_training.py (TP training against one device, without Ray)
or in faulty.py (workers with faults): tests never import each other.
"""
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time

import torch

from raytp.config import from_dict
from raytp.runtime.driver.driver import Driver
from raytp.runtime.worker.worker import Worker
from raytp.files import checkpoint

SMALL = {
    "model": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32, "vocab_size": 256},
    "train": {"steps": 12, "batch_size": 8, "lr": 3e-3, "warmup_steps": 2, "eval_interval": 6,
              "steps_per_call": 4},
}
# A small MoE Llama (4 experts, top 2) on SMALL's sizes: the expert-parallel jobs' model.
SMALL_MOE = {"arch": "llama", "n_head": 4, "n_kv_head": 2, "intermediate_size": 96,
             "moe": {"n_experts": 4, "top_k": 2, "moe_ffn": 32, "aux_coeff": 0.01}}
FIXED = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(5))  # a batch to compare logits on
RECOVERY_STEPS = 16
# The ceiling of a wait for an event (a node up, a job shrunk, a spare started): far past a slow, loaded
# machine, so that a test fails when the event never comes, not when it comes slowly.
NEVER_S = 300.0


# -- jobs -------------------------------------------------------------------------------------------
def job(tp=1, dp=1, model=None, steps=None, checkpoint=None, recovery=None, **runtime):
    """The small test job at layout tp x dp; `runtime` keys go to its runtime section."""
    d = json.loads(json.dumps(SMALL))
    d["parallel"] = {"tp": tp, "dp": dp}
    d["model"].update(model or {})
    d["train"]["steps"] = steps or d["train"]["steps"]
    d["runtime"] = {"placement_timeout_s": NEVER_S, **runtime}  # tests that want no capacity set their own
    d["checkpoint"] = checkpoint or {}
    d["recovery"] = recovery or {}
    return from_dict(d)


EP_STEPS = 8


def parallel(cfg, **degrees):
    """Job `cfg` with these `parallel` keys changed (pp=2, ep=2, zero=1, ...)."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **degrees))


def ep_job(tp, dp, ep, etp=None, zero=0, step_timeout_s=30.0, **recovery):
    """SMALL_MOE at TP x DP x EP (etp, zero): EP_STEPS steps, a checkpoint every 4, a snapshot after each step."""
    cfg = job(tp, dp, steps=EP_STEPS, checkpoint={"every": 4, "keep": 2}, recovery={"snapshot_every": 1, **recovery},
              model=SMALL_MOE, step_timeout_s=step_timeout_s)
    return parallel(cfg, ep=ep, etp=etp, zero=zero)


def recovery_job(tp, dp, **kw):
    """A job for the recovery tests: a checkpoint at the end, a snapshot after every step (unless set)."""
    return job(tp, dp, steps=RECOVERY_STEPS, checkpoint={"every": RECOVERY_STEPS, "keep": 2},
               recovery={"snapshot_every": 1, **kw.pop("recovery", {})}, step_timeout_s=kw.pop("step_timeout_s", 30.0),
               **kw)


# -- a run dir --------------------------------------------------------------------------------------
def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl")]


def events(run_dir, kind=None):
    evs = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    return [e for e in evs if kind is None or e["kind"] == kind]


def steps_logged(run_dir):
    try:
        return sum(1 for _ in open(run_dir / "metrics.jsonl"))
    except FileNotFoundError:
        return 0


def full_state(location) -> dict:
    """The one-device state ({"model", "optim"}) of the checkpoint at `location` (or the newest under it)."""
    ckpt = checkpoint.find(str(location))
    out: dict = {"model": {}, "optim": {}}
    for key in ckpt.keys():
        section, name, *k = key.split("/")
        t = ckpt.read(key, 0, 1)
        if section == "model":
            out["model"][name] = t
        else:
            out["optim"].setdefault(name, {})[k[0]] = t
    return out


def final_state(run_dir, steps=RECOVERY_STEPS):
    return full_state(run_dir / "checkpoints" / checkpoint.step_dir(steps))


def assert_bitwise_equal(a, b):
    for n in a["model"]:
        assert torch.equal(a["model"][n], b["model"][n]), n
        for k in a["optim"][n]:
            assert torch.equal(a["optim"][n][k], b["optim"][n][k]), (n, k)


# -- driving a Driver -------------------------------------------------------------------------------
def drive(cfg, run_dir, run, until=None, init_state=None):
    """Start a Driver, train to `until`, return (driver, logits at the start, logits at the end)."""
    d = Driver(cfg, run_dir, run, out=open("/dev/null", "w"), init_state=init_state)
    d.start()
    start_logits = d.logits(FIXED)
    d.train_loop(until=until)
    return d, start_logits, d.logits(FIXED)


def close(d):
    d.release()
    d.log.close()


def _one_device(rank, world, init_method, job_dict):
    w = Worker(job_dict, rank)
    cfg = w.cfg
    w.setup(cfg.layout, init_method)
    per_call, records = cfg.train.steps_per_call, []
    for start in range(0, cfg.train.steps, per_call):
        count = min(per_call, cfg.train.steps - start)
        records += [r for r in w.run_steps(start, count, 0, seq=start // per_call) if "loss" in r]
    return records


def one_device_records(cfg) -> list[dict]:
    """Every step's record (its loss, tokens, ...) of job `cfg` (at tp = dp = 1) trained on one device by a Worker
    in a process forked from this one (raytp.parallel.spawn): no Ray, no worker start (~3 s of CPU each), the
    steps a one-rank run's worker takes (its losses are that run's bit for bit). The reference of the tests that
    check a layout's run against one device within a bound."""
    from raytp.parallel.spawn import run_ranks
    assert cfg.layout.world_size == 1, "a one-device reference is a job at tp = dp = 1"
    return run_ranks(1, _one_device, cfg.to_dict())[0]


def one_device_losses(cfg) -> list[float]:
    """one_device_records' losses."""
    return [r["loss"] for r in one_device_records(cfg)]


def run(cfg, run_dir, name, faults=(), worker_cls=Worker):
    """Run a job in a thread; `faults` are (after_step, action(run_name)) applied from outside. A worker class
    that holds a step until something happens (`holds_s`: faulty.hold_until) holds its peers in that step's
    collectives: their timeout outlasts the hold, so a slow event fails as the hold's own error, if ever, and
    never as gloo's ("Application timeout caused pair closure" under CI's load, at 120 s)."""
    if getattr(worker_cls, "holds_s", 0):
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(
            cfg.runtime, collective_timeout_s=max(cfg.runtime.collective_timeout_s, 2 * worker_cls.holds_s)))
    d = Driver(cfg, run_dir, name, out=open(run_dir.parent / f"{name}.out", "w"))
    d.worker_cls = worker_cls
    errors = []
    t = threading.Thread(target=lambda: errors.append(run_catching(d)), daemon=True)
    t.start()
    for after, action in faults:
        while t.is_alive() and steps_logged(run_dir) < after:
            time.sleep(0.005)
        action(name)
    t.join(timeout=NEVER_S)
    assert not t.is_alive(), f"the job did not finish within {NEVER_S:g}s"
    assert errors == [None], errors
    return d


def wait_for(condition, what):
    """Poll `condition` until it is true (returned); fail with `what` after NEVER_S."""
    deadline = time.monotonic() + NEVER_S
    while not (got := condition()):
        assert time.monotonic() < deadline, f"{what} (waited {NEVER_S:g}s)"
        time.sleep(0.05)
    return got


def run_catching(d):
    try:
        d.run_to_end()
    except Exception as e:  # noqa: BLE001 - handed to the test
        return e


def raytp_cli(*args):
    """`python -m raytp.cli ARGS`, which must succeed; the finished process."""
    p = subprocess.run([sys.executable, "-m", "raytp.cli", *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


# -- Ray's view -------------------------------------------------------------------------------------
def ray_actors(name_prefix: str, alive_only: bool = True) -> dict[str, dict]:
    """Actors as Ray's GCS records them, by name: {"name": {"node_id", "pid", "state"}}; of two alive under one
    name (a replaced rank's old actor not yet marked dead), the one started last."""
    from ray._private import state
    out = {}
    for a in sorted(state.actors().values(), key=lambda a: a.get("StartTime") or 0):
        if a.get("Name", "").startswith(name_prefix) and (not alive_only or a["State"] == "ALIVE"):
            out[a["Name"]] = {"node_id": a["Address"]["NodeID"], "pid": a["Pid"], "state": a["State"]}
    return out


def signal_rank(rank, sig):
    """A fault: send `sig` to the process of rank `rank` (found by its actor name)."""
    def action(run_name):
        name = f"raytp.{run_name}.rank{rank}"
        pid = ray_actors(name)[name]["pid"]  # the pid as Ray's actor table has it
        os.kill(pid, sig)
    return action


@contextlib.contextmanager
def gpu_cluster(gpu_nodes: int, system_config: dict | None = None):
    """A simulated cluster: a head with no GPUs (the driver's node) and `gpu_nodes` nodes of 2 CPUs
    and 2 fake GPUs each, on loopback; connected, and shut down afterwards. Yields (cluster, nodes)."""
    import ray
    from ray.cluster_utils import Cluster
    # No dashboard, no log monitor (~2 and ~3 s of CPU per cluster, the log monitor tailing every worker's log
    # for the whole module): nothing here asks them; each node's own agents still run.
    head = {"num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "include_log_monitor": False}
    if system_config:
        head["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = [cluster.add_node(num_cpus=2, num_gpus=2) for _ in range(gpu_nodes)]
    ray.init(address=cluster.address, namespace="raytp", log_to_driver=False)
    cluster.wait_for_nodes(timeout=NEVER_S)
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def gpu_nodes(cluster, n):
    """Exactly `n` GPU nodes (2 CPUs, 2 GPUs) alive, whatever the tests before removed or added: idle
    ones removed or new ones added. Returns them."""
    nodes = list(cluster.worker_nodes)
    for node in nodes[n:]:
        cluster.remove_node(node)
    nodes = nodes[:n] + [cluster.add_node(num_cpus=2, num_gpus=2) for _ in range(n - len(nodes))]
    cluster.wait_for_nodes(timeout=NEVER_S)
    return nodes


def resume_run(cfg, location, run_dir, name):
    """Train job `cfg` to its end from the checkpoint at `location` (any layout's), in this process."""
    from raytp.runtime.origin import from_checkpoint
    d = Driver(cfg, run_dir, name, out=open(os.devnull, "w"), init_state=from_checkpoint(str(location), cfg))
    try:
        d.start()
        d.train_loop()
    finally:
        close(d)


def lose_a_named_node(cluster, nodes, cfg, run_dir, name, which, reference, joins: bool = False):
    """Run job `cfg` in `run_dir` on GPU `nodes` of a simulated `cluster` and, after step 6, remove the
    `which`-th node its `survival` event names (every one of which it survives; with `joins`, a fresh 2-GPU
    node joins for its ranks): the start line said so, the state ends bit for bit as `reference`'s (a
    final_state), and the lost ranks came back from their replicas with no step lost."""
    by_id = {n.node_id: n for n in nodes}
    removed = []

    def remove(run_name):
        (ev,) = events(run_dir, "survival")
        assert len(ev["nodes"]) >= 2 and all(ev["nodes"].values()), ev
        node_id = list(ev["nodes"])[which % len(ev["nodes"])]
        cluster.remove_node(by_id[node_id])
        removed.append(node_id)
        if joins:
            cluster.add_node(num_cpus=2, num_gpus=2)

    run(cfg, run_dir, name, faults=[(6, remove)])
    assert "node loss: survives the loss of any 1 node without a checkpoint" in (
        run_dir.parent / f"{name}.out").read_text()
    assert_bitwise_equal(final_state(run_dir), reference)
    fails = events(run_dir, "failure")
    assert fails and {f["node"] for f in fails} == set(removed)
    (rec,) = events(run_dir, "recovered")
    assert rec["lost_steps"] == 0 and rec["source"] == "replica", rec
