"""The Worker actor: one per rank, owns its shard of weights and optimizer state.

The driver creates it inside the run's placement group, asks rank 0 for a
rendezvous address, then calls ``setup`` on every rank at once (they meet in
torch.distributed), and drives training with ``train`` calls of several steps
each, so Ray's per-call cost stays off the hot path.

The class is plain Python; ``remote_worker`` wraps it for Ray. The CUDA path
differs from the CPU path only in ``device`` and the backend picked from it:
Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, which is then cuda:0.
"""
from __future__ import annotations

import os
import time

import torch

from raytp.config import JobConfig, from_dict
from raytp.model import GPTConfig
from raytp.parallel import comm
from raytp.parallel.groups import destroy_process_groups, init_process_groups
from raytp.parallel.layout import Layout
from raytp.parallel.spawn import free_port
from raytp.train import checkpoint
from raytp.train.data import batch, load_corpus
from raytp.train.step import Hyper, eval_loss, make_optimizer, train_step
from raytp.parallel.plan import build_shard


def gpt_config(cfg: JobConfig) -> GPTConfig:
    m = cfg.model
    return GPTConfig(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, block_size=m.block_size,
                     vocab_size=m.vocab_size, dropout=m.dropout)


def hyper(cfg: JobConfig) -> Hyper:
    t = cfg.train
    return Hyper(lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, steps=t.steps, lr_schedule=t.lr_schedule,
                 weight_decay=t.weight_decay, beta1=t.beta1, beta2=t.beta2, grad_clip=t.grad_clip, seed=t.seed)


class Worker:
    def __init__(self, job: dict, rank: int):
        self.cfg = from_dict(job)
        self.rank = rank
        threads = self.cfg.runtime.threads_per_worker
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device("cuda", 0) if self.cfg.runtime.device == "cuda" else torch.device("cpu")
        self.groups = self.model = self.optimizer = None
        self.corpus = load_corpus(self.cfg.data.source, self.cfg.data.val_fraction)
        if self.corpus.vocab_size > self.cfg.model.vocab_size:
            raise ValueError(f"data.source has token ids up to {self.corpus.vocab_size - 1} but "
                             f"model.vocab_size={self.cfg.model.vocab_size}; raise model.vocab_size")

    # -- placement and rendezvous ------------------------------------------------
    @staticmethod
    def _node_ip() -> str:
        """The address this node registered with Ray (127.0.0.1 for a loopback-only cluster)."""
        import ray
        node_id = ray.get_runtime_context().get_node_id()
        return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)

    def where(self) -> dict:
        """Node, pid and address, as Ray and the OS see them (for the driver's records)."""
        import ray
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "ip": self._node_ip(), "gpu_ids": ctx.get_accelerator_ids().get("GPU", [])}

    def rendezvous_address(self) -> str:
        """tcp://<this node's ip>:<a free port>, for rank 0 to host the store."""
        ip = self._node_ip()
        return f"tcp://{ip}:{free_port(ip)}"

    def setup(self, tp: int, dp: int, init_method: str) -> dict:
        """Join the process groups and build this rank's shard from the seeded full initialisation."""
        t0 = time.perf_counter()
        layout = Layout(tp, dp)
        self.groups = init_process_groups(layout, self.rank, init_method, self.cfg.runtime.device,
                                          self.cfg.runtime.collective_timeout_s)
        self.model = build_shard(gpt_config(self.cfg), self.cfg.train.seed, self.groups.tp,
                                 self.cfg.parallel.sequence_parallel).to(self.device)
        self.hyper = hyper(self.cfg)
        self.optimizer = make_optimizer(self.model, self.hyper)
        n_local = sum(p.numel() for p in self.model.parameters())
        return {"rank": self.rank, "params_local": n_local, "setup_s": time.perf_counter() - t0}

    # -- training ------------------------------------------------------------------
    def _micro_batches(self, split: str, step: int) -> list:
        cfg, g = self.cfg, self.groups
        x, y = batch(self.corpus, split, cfg.train.seed, step, g.dp_rank, g.layout.dp,
                     cfg.train.batch_size, cfg.model.block_size)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        n = cfg.micro_batch
        return list(zip(x.split(n), y.split(n)))

    def train(self, start: int, count: int) -> list[dict]:
        """Run optimizer steps start .. start+count-1; returns one record per step."""
        out = []
        for step in range(start, start + count):
            comm.STATS.take()
            t0 = time.perf_counter()
            r = train_step(self.model, self.optimizer, self._micro_batches("train", step), self.groups, step,
                           self.hyper)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            out.append({"step": step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                        "step_time_s": elapsed, "comm_s": comm.STATS.take()[0]})
        return out

    def evaluate(self, step: int) -> float:
        cfg = self.cfg
        batches = []
        for i in range(cfg.train.eval_steps):
            batches += self._micro_batches("val", step * cfg.train.eval_steps + i)
        return eval_loss(self.model, batches, self.groups)

    # -- state ---------------------------------------------------------------------
    def get_state(self) -> dict:
        """This rank's weights and AdamW state (CPU tensors), for checkpoints and snapshots."""
        return checkpoint.shard_state(self.model, self.optimizer)

    def set_state(self, full: dict) -> None:
        """Take this rank's slices of a full one-device state (weights, and AdamW state if present)."""
        g = self.groups
        checkpoint.load_shard_state(self.model, self.optimizer,
                                    checkpoint.slice_state(full, g.tp_rank, g.layout.tp))

    @torch.no_grad()
    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (B, T, V) of a batch, gathered over TP (every TP rank must be called)."""
        self.model.eval()
        local = self.model(idx.to(self.device))  # (B, T, V_pad/tp)
        self.model.train()
        return comm.gather_last(local, self.groups.tp)[..., :self.cfg.model.vocab_size].cpu()

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        destroy_process_groups()
