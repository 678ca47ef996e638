"""States, checkpoints and datasets made in the test process, without Ray: a trained-looking state's TP shards,
a checkpoint written from them as the driver and its workers write one, a prepared dataset written by hand from
the format, a Hugging Face directory loaded as a TP rank (in a spawned rank). (helpers.py: jobs, runs, run dirs.)
"""
import torch

from raytp.config import from_dict
from raytp.files import checkpoint


class Events:
    def __init__(self):
        self.seen = []

    def event(self, kind, **fields):
        self.seen.append({"kind": kind, **fields})


class ShardsGroup:
    """What raytp.runtime.state.checkpoints asks of a worker group, for shards held in this process: each
    rank's file written at once (the tests of the format and of the commit need no Ray)."""

    def __init__(self, shards: list[dict], model_cfg, dp: int = 1):
        self.shards = shards
        self.cfg = from_dict({"model": {k: v for k, v in model_cfg.__dict__.items()},
                              "parallel": {"tp": len(shards), "dp": dp}})

    def state_calls(self):  # its own calls that move state (a WorkerGroup hands out a StateCalls)
        return self

    def begin_save(self, url, directory):
        from raytp.files.storage import Storage
        tensors = [checkpoint.state_tensors(sh) for sh in self.shards]
        results = [checkpoint.write_shard(Storage(url), directory, t, r) for r, t in enumerate(tensors)]
        return checkpoint.tensor_table(tensors[0], len(self.shards), self.cfg.model.vocab_size), results

    @staticmethod
    def answered(refs, timeout_s=0.0):
        return True

    @staticmethod
    def fetch(refs):
        return list(refs)


def save_shards(root, step, shards, model_cfg, dp=1, keep=3, run_id="test-run"):
    """Save per-rank shard states as the driver and its workers do, as run `run_id`; the checkpoint's path."""
    from raytp.runtime.state.checkpoints import Checkpoints
    ckpts = Checkpoints(str(root), keep, Events(), run_id)
    group = ShardsGroup(shards, model_cfg, dp)
    ckpts.begin(group, step)
    return ckpts.finish(group)

def small_state(tp):
    """A trained-looking state as TP shards, without Ray: for the on-disk tests."""
    from raytp.models.args import ModelArgs
    from raytp.models.gpt2.model import GPT
    cfg = ModelArgs(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=37)
    torch.manual_seed(0)
    model = GPT(cfg)
    from raytp.train.hyper import Hyper
    from raytp.train.optimizer import make_optimizer
    opt = make_optimizer(model, Hyper())
    model(torch.randint(37, (2, 8)), torch.randint(37, (2, 8))).backward()
    opt.step()
    from raytp.train.shard_state import shard_state, slice_state
    full = shard_state(model, opt)
    return cfg, full, [slice_state(full, r, tp) for r in range(tp)]


def hf_shard_at_tp(rank, world, init, model_dir, ep=1, etp=None):
    """In a spawned rank (raytp.parallel.spawn.run_ranks): join gloo, and load a Hugging Face directory as TP
    rank `rank` of `world` (its experts spread over `ep` ranks, `etp` 1: whole on each TP rank), each rank
    reading its own slices: (model shard, its ProcessGroups)."""
    import torch.distributed as dist
    from raytp.files.interop import hf
    from raytp.models.moe.plan import ExpertPlace
    from raytp.models.shard import build_empty_shard
    from raytp.parallel.groups import build_groups
    from raytp.parallel.layout import Layout
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = build_groups(Layout(world, dp=1, ep=ep, etp=etp), rank)
    model = build_empty_shard(hf.inspect(model_dir), groups.tp, experts=ExpertPlace.of(groups))
    hf.load_into(model_dir, model, groups.tp_rank, world)
    return model, groups


def write_prepared(root, seed, lo, hi, shards=2, docs=80, eod=255, sha="test"):
    """A raytp prepared dataset written by hand from the format (raytp.data.manifest; the manifest last):
    `shards` shards of `docs` documents of ids in [lo, hi), each ended by `eod`; returns its path."""
    import numpy as np
    from raytp.data import manifest as mf
    from raytp.data.indexed import write_indexed
    rng = np.random.default_rng(seed)
    root.mkdir()
    listed = []
    for s in range(shards):
        ds = [np.append(rng.integers(lo, hi, rng.integers(5, 60)), eod) for _ in range(docs)]
        write_indexed(root / f"shard-{s:05d}", ds, np.uint16)
        listed.append(mf.Shard(f"shard-{s:05d}", len(ds), int(sum(len(d) for d in ds))))
    m = mf.Manifest({"sha256": sha, "vocab_size": 256, "eod_id": eod, "eod_token": "<eod>"}, "uint16",
                    tuple(listed), ("test",))
    (root / mf.NAME).write_text(m.to_json())
    return str(root)
