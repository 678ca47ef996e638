"""An unbroken run of a job without Ray: the job's Workers in processes forked from the test process
(raytp.parallel.spawn), joined over gloo as a Ray run's are, taking the driver's calls in the driver's order (its
streamed calls cut at each evaluation and checkpoint, the validation loss after the steps it is due after, the
last checkpoint written by the ranks that own the state and committed as the driver commits it). Its run dir
holds what the tests read of a reference run: metrics.jsonl (each step's loss, lr, grad_norm, tokens and, where
evaluated, val_loss) and the checkpoints; bit for bit a Ray run's (test_reference_runs). No worker start (~1.6 s of
CPU each), no Ray run around it."""
import json

from raytp.moves.owners import Owners
from raytp.parallel.spawn import run_ranks
from raytp.runtime import policy
from raytp.runtime.state.checkpoints import Checkpoints
from raytp.runtime.worker.worker import Worker


def _rank(rank, world, init_method, job: dict, url: str, directory: str):
    """One rank's run: (its records of the steps it reports, its validation losses by step, the table and the
    write result of its checkpoint file, or None where it owns no state)."""
    w = Worker(job, rank)
    cfg, t = w.cfg, w.cfg.train
    w.setup(cfg.layout, init_method)
    records, vals, step, seq = [], {}, 0, 0
    while step < t.steps:
        n = policy.call_length(step, t.steps, t.steps_per_call, True, t.eval_interval, cfg.checkpoint.every)
        records += [r for r in w.run_steps(step, n, 0, seq) if isinstance(r, dict) and "loss" in r]
        step, seq = step + n, seq + 1
        if policy.evaluation_due(step, t.steps, t.eval_interval):
            vals[step] = w.evaluate(step)
    saved = None
    if rank in Owners(cfg.layout).owners():
        saved = (w.begin_save(url, directory), w.save_result())
    return records, vals, saved


class _Forked:
    """What raytp.runtime.state.checkpoints asks of a worker group, for a job trained in forked ranks when its
    one checkpoint (at the last step) begins."""

    def __init__(self, cfg):
        self.cfg, self.layout, self.ranks = cfg, cfg.layout, None

    def state_calls(self):
        return self

    def begin_save(self, url, directory):
        self.ranks = run_ranks(self.layout.world_size, _rank, self.cfg.to_dict(), url, directory, timeout_s=600)
        saved = [s for _, _, s in self.ranks if s is not None]
        return {k: v for table, _ in saved if table for k, v in table.items()}, [result for _, result in saved]

    @staticmethod
    def fetch(results):
        return list(results)


def unbroken_run(cfg, run_dir, run_id: str) -> None:
    """Train job `cfg` (a checkpoint at its last step and none before) in forked ranks; write its run dir."""
    t = cfg.train
    assert cfg.checkpoint.every == t.steps, "a reference run checkpoints once, at its last step"
    run_dir.mkdir(parents=True, exist_ok=True)
    group = _Forked(cfg)
    ckpts = Checkpoints(str(run_dir / "checkpoints"), cfg.checkpoint.keep, _NoLog(), run_id)
    ckpts.begin(group, t.steps)  # the whole run happens here
    ckpts.finish(group)
    records = next(recs for recs, _, _ in group.ranks if recs)  # the first reporting rank's, as the driver's
    vals = group.ranks[0][1]  # rank 0's answer, as the driver's
    tokens_per_step = t.batch_size * cfg.model.block_size
    lay = cfg.layout
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in records:
            line = {"step": r["step"], "loss": r["loss"], "lr": r["lr"], "grad_norm": r["grad_norm"],
                    "tokens": tokens_per_step * (r["step"] + 1), "tp": lay.tp, "pp": lay.pp, "dp": lay.dp}
            if r["step"] + 1 in vals:
                line["val_loss"] = vals[r["step"] + 1]
            f.write(json.dumps(line) + "\n")


class _NoLog:
    @staticmethod
    def event(kind, **fields):
        pass
