"""A run's records also sent to experiment trackers: TensorBoard, Weights & Biases, MLflow (``tracking``).

The driver's run log (raytp.runtime.driver.metrics.RunLog) hands every step record (metrics.jsonl's line)
and every event (events.jsonl's) to ``Trackers``, which sends them on to each tracker the job names:
- step records as scalars at their step: every number of the record (loss, val_loss, lr, grad_norm,
  tokens_per_s, step_time_s, comm_s, tflops, mfu, peak_mem_bytes, data_s, the straggler's ratio);
- events as a count per kind at the last step (`events/failure`, `events/recovered`, `events/resized`, ...)
  and their fields as text (TensorBoard), a tag (MLflow) or in the run's summary (W&B).
W&B's and MLflow's run ids are kept in the run directory (``wandb_run_id``, ``mlflow_run_id``), so a run
resumed in it (``--resume``) goes on with the same tracker run. A TensorBoard directory given as a storage
URL is written locally (<run dir>/tensorboard) and copied there on every flush and at the end.
The libraries are imported only when named (``pip install 'raytp[tracking]'``).
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

SKIP = {"step", "time", "tp", "pp", "dp", "tokens"}  # not scalars to plot
FLUSH_EVERY = 50  # steps between copies of a TensorBoard directory to its URL


class TrackingError(RuntimeError):
    """A tracker named by the job could not be started (its message says which and why)."""


def scalars(rec: dict) -> dict[str, float]:
    """The numbers of a step record to plot."""
    out = {k: float(v) for k, v in rec.items() if k not in SKIP and isinstance(v, (int, float))
           and not isinstance(v, bool)}
    for layer, figures in (rec.get("experts") or {}).items():  # an expert layer's: experts/<layer>/imbalance ...
        out.update({f"experts/{layer}/{k}": float(v) for k, v in figures.items()})
    if isinstance(rec.get("straggler"), dict):
        out["straggler_ratio"] = float(rec["straggler"]["ratio"])
    return out


def _kept_id(run_dir: Path, name: str) -> str | None:
    f = run_dir / name
    return f.read_text().strip() if f.exists() else None


class TensorBoard:
    def __init__(self, target: str, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.url = target if "://" in target else None
        self.local = run_dir / "tensorboard" if self.url else Path(target)
        self.writer = SummaryWriter(log_dir=str(self.local))
        self.steps = 0

    def metric(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.steps += 1
        if self.url and self.steps % FLUSH_EVERY == 0:
            self._copy()

    def event(self, step: int, kind: str, count: int, rec: dict) -> None:
        self.writer.add_scalar(f"events/{kind}", count, step)
        self.writer.add_text(f"events/{kind}", json.dumps(rec), step)

    def _copy(self) -> None:
        from raytp.files.storage import Storage
        self.writer.flush()
        storage = Storage(self.url)
        for f in self.local.rglob("*"):
            if f.is_file():
                storage.write_bytes(str(f.relative_to(self.local)), f.read_bytes())

    def close(self, status: str) -> None:
        self.writer.close()
        if self.url:
            self._copy()


class Wandb:
    def __init__(self, target, cfg, run_dir: Path, run: str):
        import wandb
        self.wandb = wandb
        run_id = _kept_id(run_dir, "wandb_run_id") or uuid.uuid4().hex[:8]
        (run_dir / "wandb_run_id").write_text(run_id)
        self.run = wandb.init(project=target.project, entity=target.entity, name=target.name or run, id=run_id,
                              resume="allow", dir=str(run_dir), config=cfg.to_dict(), reinit="create_new")

    def metric(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def event(self, step: int, kind: str, count: int, rec: dict) -> None:
        self.run.summary[f"last_{kind}"] = rec
        self.run.log({f"events/{kind}": count}, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


class Mlflow:
    def __init__(self, target, cfg, run_dir: Path, run: str):
        import mlflow
        self.client = mlflow.tracking.MlflowClient(tracking_uri=target.uri)
        run_id = _kept_id(run_dir, "mlflow_run_id")
        if run_id is None:
            exp = self.client.get_experiment_by_name(target.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(target.experiment)
            run_id = self.client.create_run(exp_id, run_name=run).info.run_id
            flat = {f"{s}.{k}": str(v) for s, body in cfg.to_dict().items() if isinstance(body, dict)
                    for k, v in body.items()}
            self.client.log_batch(run_id, params=[mlflow.entities.Param(k, v[:500]) for k, v in flat.items()])
            (run_dir / "mlflow_run_id").write_text(run_id)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id, self.entities = run_id, mlflow.entities

    def metric(self, step: int, values: dict[str, float]) -> None:
        import time
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.entities.Metric(k, v, now, step) for k, v in values.items()])

    def event(self, step: int, kind: str, count: int, rec: dict) -> None:
        self.client.log_metric(self.run_id, f"events_{kind}", count, step=step)
        self.client.set_tag(self.run_id, f"last_{kind}", json.dumps(rec)[:5000])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if status == "finished" else
                                   "KILLED" if status == "stopped" else "FAILED")


class Trackers:
    """Every tracker `cfg.tracking` names, fed the run's records (raytp.runtime.driver.metrics.RunLog)."""

    def __init__(self, cfg, run_dir: Path, run: str, step: int = 0):
        """`step`: where the run starts (a resumed one: its checkpoint's), the step of events before the first."""
        t, self.sinks = cfg.tracking, []
        self.step, self.counts, self.status = step, {}, "failed"
        if t.tensorboard or t.wandb or t.mlflow:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
        makers = [("tracking.tensorboard", t.tensorboard, lambda: TensorBoard(t.tensorboard, Path(run_dir))),
                  ("tracking.wandb", t.wandb, lambda: Wandb(t.wandb, cfg, Path(run_dir), run)),
                  ("tracking.mlflow", t.mlflow, lambda: Mlflow(t.mlflow, cfg, Path(run_dir), run))]
        for key, target, make in makers:
            if target is None:
                continue
            try:
                self.sinks.append(make())
            except Exception as e:  # noqa: BLE001 - any library's failure to start, named by key
                self.close()
                raise TrackingError(f"{key}: could not start ({type(e).__name__}: {e})") from None

    def metric(self, rec: dict) -> None:
        self.step = rec["step"]
        values = scalars(rec)
        for s in self.sinks:
            s.metric(rec["step"], values)

    def event(self, rec: dict) -> None:
        kind = rec["kind"]
        if kind in ("finished", "failed", "stopped"):
            self.status = kind
        self.counts[kind] = self.counts.get(kind, 0) + 1
        fields = {k: v for k, v in rec.items() if k != "kind"}
        for s in self.sinks:
            s.event(self.step, kind, self.counts[kind], fields)

    def close(self) -> None:
        for s in self.sinks:
            s.close(self.status)
        self.sinks = []
