"""An elastic job's shrink after a node loss and its grow-back once a node joins, on a simulated cluster: the run
shared by the dense, context-parallel and expert-parallel elastic tests (test_node_loss, test_node_loss_experts)."""
import json

import ray

from helpers import events, ray_actors, run, steps_logged, wait_for
from raytp.runtime.driver.control_actor import find_control
from raytp.runtime.worker.worker import Worker


def shrink_and_grow_back(cluster, nodes, cfg, run_dir, name, victim: int, after_grow: int = 3, worker_cls=Worker,
                         as_it_goes=lambda: None):
    """Run elastic job `cfg` (parallel.min_dp set, `train.steps` only keeping it alive) on GPU `nodes` of
    `cluster`: after step 6 the node of rank `victim` goes, with no room for its ranks (the job shrinks); once
    it has, a 2-GPU node joins (it grows back); `after_grow` steps later it is stopped as `raytp stop` stops it.
    Checks what every such run shows (one shrink for lost capacity, then one grow-back, a line for each step
    up to the stop, which came before the last step, the loss falling) and returns (the two `resized` events,
    the metrics lines). `as_it_goes()` is called right before the node goes; the workers are `worker_cls`."""
    alive, dp = {n.node_id: n for n in nodes}, cfg.parallel.dp

    def remove_the_victims_node(run_name):
        actor = f"raytp.{run_name}.rank{victim}"
        as_it_goes()
        cluster.remove_node(alive[ray_actors(actor)[actor]["node_id"]])

    def add_a_node_once_shrunk(run_name):
        wait_for(lambda: [e for e in events(run_dir, "resized") if e["new"]["dp"] < dp], "the job did not shrink")
        cluster.add_node(num_cpus=2, num_gpus=2)

    def stop_a_few_steps_after_the_grow_back(run_name):
        wait_for(lambda: [e for e in events(run_dir, "resized") if e["new"]["dp"] == dp], "the job did not grow back")
        grown_at = steps_logged(run_dir)
        wait_for(lambda: steps_logged(run_dir) >= grown_at + after_grow, f"the job did not train on at DP {dp}")
        ray.get(find_control(run_name).request.remote("stop"))  # what `raytp stop` files

    run(cfg, run_dir, name, faults=[(6, remove_the_victims_node), (7, add_a_node_once_shrunk),
                                    (8, stop_a_few_steps_after_the_grow_back)], worker_cls=worker_cls)
    resized = events(run_dir, "resized")
    assert len(resized) == 2 and resized[0]["old"]["dp"] == dp == resized[1]["new"]["dp"], resized
    assert resized[0]["reason"].startswith("lost capacity") and resized[1]["reason"] == "capacity returned"
    (stopped,) = events(run_dir, "stopped")
    assert stopped["reason"] == "requested" and stopped["step"] < cfg.train.steps, "the job ended before the grow-back"
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(stopped["step"]))
    assert [m["dp"] for m in metrics[-after_grow:]] == [dp] * after_grow
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 1.0
    return resized, metrics
