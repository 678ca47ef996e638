"""Live resizes of the stages: TP=2 x PP=1 -> TP=2 x PP=2 -> TP=2 x PP=2 x DP=2 -> TP=2 x PP=1 -> TP=1 x PP=3,
while training, in memory (each new stage's shards from the old owners' bundles, each byte once); the loss
tracks one device's within 1e-4 and the model's logits do not move at a switch; a change of the stages
at the same TP degree keeps the processes of replica 0's stages present at both layouts, and a TP change at
pp > 1 starts every new worker beside the running ones (which held their names); before it, a try whose new
worker dies while it starts is refused and leaves the job as it was. The first switch is filed as `raytp
scale` files it (the control actor), the others through Driver.resize."""
import dataclasses
import io
import json

import numpy as np
import pytest
import ray

from helpers import FIXED, job, losses, one_device_losses, ray_actors, wait_for
from raytp.runtime.driver.driver import Driver

pytestmark = pytest.mark.slow  # up to 8 workers and two layouts at once on 2 cores

PHASES = [(2, 1, 1), (2, 2, 1), (2, 2, 2), (2, 1, 1), (1, 3, 1)]  # (tp, pp, dp), 3 steps each at least
STEPS = 200  # room for the first switch's new ranks to start while the job trains on (not all trained)


@pytest.fixture(scope="module")
def ray_wide(no_shared_ray):
    ray.init(address="local", num_cpus=16, include_dashboard=False, namespace="raytp", log_to_driver=False)
    yield
    ray.shutdown()


def the_job():
    cfg = job(2, 1, model={"n_layer": 3}, steps=STEPS)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps_per_call=3, eval_interval=0))


def test_stages_resize_live_and_the_loss_tracks_one_device(ray_wide, tmp_path):
    d = Driver(the_job(), tmp_path / "run", "ppresized", out=io.StringIO())
    try:
        d.start()
        for i, (tp, pp, dp) in enumerate(PHASES):
            if i:
                before = d.logits(FIXED)
                pids = {n: a["pid"] for n, a in ray_actors("raytp.ppresized.rank").items()}
                if i == 1:  # what `raytp scale RUN --pp 2` files, served at the next step boundary
                    rid = ray.get(d.control.actor.request.remote("scale", tp=tp, pp=pp, dp=dp))
                    while ray.get(d.control.actor.outcome.remote(rid)) is None:  # trains on while ranks start
                        assert d.step < STEPS, "the new ranks did not start before the job's end"
                        d.train_loop(until=d.step + 1)
                    assert ray.get(d.control.actor.outcome.remote(rid))["ok"]
                else:
                    if tp != PHASES[i - 1][0]:  # first a try whose new worker dies while it starts: nothing changes
                        assert d.request_resize(d.layout.changed(tp=tp, dp=dp, pp=pp)) is None
                        ray.kill(d.changes.elastic.pending.early[0][0])
                        failed = d.advance_resize(now=True)
                        assert not failed.ok and "rolled back" in failed.error, failed
                        assert (d.layout.tp, d.layout.pp, d.layout.dp) == PHASES[i - 1]
                        assert float((d.logits(FIXED) - before).abs().max()) == 0.0
                        wait_for(lambda: sorted(ray_actors("raytp.ppresized.rank")) == sorted(pids),
                                 "the failed try's new workers did not go")
                    outcome = d.resize(tp=tp, dp=dp, pp=pp)
                    assert outcome.ok, outcome
                assert (d.layout.tp, d.layout.pp, d.layout.dp) == (tp, pp, dp)
                if i > 1:  # (the first switch came after the steps trained while its ranks started)
                    after = d.logits(FIXED)
                    assert float((after - before).abs().max()) < 1e-5, f"logits moved at {PHASES[i - 1]} -> {tp, pp, dp}"
                names = ray_actors("raytp.ppresized.rank")
                held = [p["actor"] for p in d.group.placement]  # each rank's actor, by name
                assert sorted(names) == sorted(held)
                ahead = [f"raytp.ppresized.rank{r}.next2" for r in range(min(np.prod(PHASES[i - 1]), tp * pp * dp))]
                if tp != PHASES[i - 1][0]:
                    # every new worker started beside the running ones; a name they held went to it as .next2
                    # (the second such start: the first was the failed try's)
                    assert held == ahead + [f"raytp.ppresized.rank{r}" for r in range(len(ahead), tp * pp * dp)]
                else:
                    assert held == [f"raytp.ppresized.rank{r}" for r in range(tp * pp * dp)]
                if tp == PHASES[i - 1][0]:  # the stages of replica 0 present at both layouts keep their processes
                    stay = [f"raytp.ppresized.rank{r}" for r in range(tp * min(pp, PHASES[i - 1][1]))]
                    assert {n: names[n]["pid"] for n in stay} == {n: pids[n] for n in stay}
            d.train_loop(until=d.step + 3)
    finally:
        d.release()
        d.log.close()
    one = the_job()
    one = dataclasses.replace(one, parallel=dataclasses.replace(one.parallel, tp=1))
    ours, theirs = np.array(losses(tmp_path / "run")), np.array(one_device_losses(one)[:d.step])  # as far as it ran
    assert len(ours) == len(theirs) == d.step
    rel = np.abs(ours - theirs) / theirs
    assert rel.max() < 1e-4, f"loss curve left one device's by {rel.max():.2e}"
    events = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl")]
    resized = [e for e in events if e["kind"] == "resized"]
    assert [tuple(e["new"][k] for k in ("tp", "pp", "dp")) for e in resized] == PHASES[1:]
    assert all(e["lost_steps"] == 0 and e["bytes"] > 0 for e in resized)
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(d.step))
    assert [(m["tp"], m["pp"], m["dp"]) for m in metrics][0] == PHASES[0]
    assert [(m["tp"], m["pp"], m["dp"]) for m in metrics[-3:]] == [PHASES[-1]] * 3
    assert {(m["tp"], m["pp"], m["dp"]) for m in metrics} == set(PHASES)
