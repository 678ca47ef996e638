"""An unbroken run of a job without Ray: the job's Workers in processes forked from the test process
(raytp.parallel.spawn), joined over gloo as a Ray run's are, taking the driver's calls in the driver's order (its
streamed calls cut at each evaluation and checkpoint, the validation loss after the steps it is due after, each
checkpoint due written by the ranks that own the state and committed as the driver commits it). Its run dir holds
what the tests read of a reference run: metrics.jsonl (the driver's line of each step, `reporting.step_record`, and
where evaluated its val_loss) and the checkpoints; bit for bit a Ray run's but for the times (test_runtime). No worker start (~1.6 s of CPU
each), no Ray run around it."""
import json
import os

from offline import Events
from raytp.files.storage import Storage
from raytp.moves.owners import Owners
from raytp.parallel.spawn import run_ranks
from raytp.runtime import policy
from raytp.runtime.driver import reporting
from raytp.runtime.state.checkpoints import Checkpoints
from raytp.runtime.worker.worker import Worker


def _stage(step: int) -> str:
    """Where the ranks write the files of the checkpoint of `step`, before the parent commits it."""
    return f".reference-{step:08d}"


def _rank(rank, world, init_method, job: dict, url: str):
    """One rank's run: (its records of the steps it reports, its validation losses by step, {step: (table, write
    result)} of the checkpoint files it wrote: none where it owns no state)."""
    w = Worker(job, rank)
    cfg, t = w.cfg, w.cfg.train
    w.setup(cfg.layout, init_method)
    owner = rank in Owners(cfg.layout).owners()
    records, vals, saved, step, seq = [], {}, {}, 0, 0
    while step < t.steps:
        n = policy.call_length(step, t.steps, t.steps_per_call, True, t.eval_interval, cfg.checkpoint.every)
        records += [r for r in w.run_steps(step, n, 0, seq) if isinstance(r, dict) and "loss" in r]
        step, seq = step + n, seq + 1
        if policy.evaluation_due(step, t.steps, t.eval_interval):
            vals[step] = w.evaluate(step)
        if owner and policy.checkpoint_due(step, t.steps, cfg.checkpoint.every, None):
            Storage(url).makedirs(_stage(step))
            saved[step] = (w.begin_save(url, _stage(step)), w.save_result())
    return records, vals, saved


class _Staged:
    """What raytp.runtime.state.checkpoints asks of a worker group, for the files of one checkpoint the forked
    ranks wrote to its stage: moved into the directory the save is committed from."""

    def __init__(self, cfg, root, step, saved: list):
        self.cfg, self.layout, self.root, self.step, self.saved = cfg, cfg.layout, root, step, saved

    def state_calls(self):
        return self

    def begin_save(self, url, directory):
        stage = self.root / _stage(self.step)
        for _, result in self.saved:
            os.replace(stage / result["file"], self.root / directory / result["file"])
        os.rmdir(stage)
        return {k: v for table, _ in self.saved if table for k, v in table.items()}, [r for _, r in self.saved]

    @staticmethod
    def fetch(results):
        return list(results)


def unbroken_run(cfg, run_dir, run_id: str) -> None:
    """Train job `cfg` in forked ranks; write its run dir (metrics.jsonl, checkpoints/)."""
    lay = cfg.layout
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    ranks = run_ranks(lay.world_size, _rank, cfg.to_dict(), str(root), timeout_s=600)
    ckpts = Checkpoints(str(root), cfg.checkpoint.keep, Events(), run_id)
    for step in sorted({s for _, _, saved in ranks for s in saved}):
        group = _Staged(cfg, root, step, [saved[step] for _, _, saved in ranks if step in saved])
        ckpts.begin(group, step)
        ckpts.finish(group)
    records = next(recs for recs, _, _ in ranks if recs)  # the first reporting rank's, as the driver's
    vals = ranks[0][1]  # rank 0's answer, as the driver's
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in records:  # the driver's line of each (its times this rank's alone)
            line = reporting.step_record(r, [r], cfg, lay)
            if r["step"] + 1 in vals:
                line["val_loss"] = vals[r["step"] + 1]
            f.write(json.dumps(line) + "\n")
