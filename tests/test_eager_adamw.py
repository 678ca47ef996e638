"""raytp.eager_adamw: torch's AdamW built and stepped without importing torch._dynamo, to the same bits."""
import subprocess
import sys
import textwrap

import torch

from raytp import eager_adamw


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 8))


def _groups(model):
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _train(model, opt, step_fn, steps=5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=g)
        model(x).pow(2).mean().backward()
        step_fn(opt)
        opt.zero_grad(set_to_none=True)


def test_the_eager_step_is_torchs_step_to_the_bit():
    ref, ours = _model(0), _model(0)
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "foreach": False, "fused": None}
    ref_opt = torch.optim.AdamW(_groups(ref), **kw)
    our_opt = eager_adamw.adamw(_groups(ours), **kw)
    _train(ref, ref_opt, lambda o: o.step())
    _train(ours, our_opt, eager_adamw.step)
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name
        for key, t in ref_opt.state[a].items():
            assert torch.equal(t, our_opt.state[b][key]), (name, key)


def test_a_step_with_hooks_is_torchs_own():
    model = _model(0)
    opt = eager_adamw.adamw(_groups(model), lr=1e-2, foreach=False)
    seen = []
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(len(o.state)))
    _train(model, opt, eager_adamw.step, steps=2)
    assert seen == [len(list(model.parameters()))] * 2


def test_a_worker_starts_and_steps_without_importing_dynamo(tmp_path):
    """A rank's whole life up to its steps and an evaluation (process.prepare, its shard, AdamW, steps) in a
    fresh process: torch._dynamo (~1.2 s of a new worker's CPU) is never imported."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from helpers import job
        from raytp.runtime.worker.worker import Worker
        cfg = job(1, 1, steps=4)
        w = Worker(cfg.to_dict(), 0)
        w.setup(cfg.layout, "file://{tmp_path / 'rendezvous'}")
        losses = [r["loss"] for r in w.run_steps(0, 3, 0, seq=0)]
        w.evaluate(3)
        assert losses[-1] < losses[0], losses
        print("dynamo imported:", "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "dynamo imported: False" in out.stdout, out.stdout
