"""Comparing raytp's shards with transformers' models, for the Hugging Face tests (Llama, Mixtral, Qwen3):
a fixed batch, transformers' logits and gradients under raytp's parameter names, and raytp's at a TP degree
(each rank loading its slices of the saved directory)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from offline import hf_shard_at_tp
from raytp.models.registry import full_size_of, split_of
from raytp.parallel import comm
from raytp.parallel.sharding import unshard_tensors
from raytp.train.step import _sum_over_tp

V, T = 256, 16


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (2, T), generator=g), torch.randint(0, V, (2, T), generator=g)


def theirs(model, experts: int = 0, ffn: int = 0):
    """transformers' logits and one step's gradients, under raytp's names: transformers 5 holds an MoE
    layer's `experts` fused in memory (gate_up_proj [E, 2 * ffn, C], down_proj [E, C, ffn]), split here per
    expert."""
    x, y = batch()
    model.zero_grad()
    logits = model(x).logits
    F.cross_entropy(logits.reshape(-1, V), y.reshape(-1)).backward()
    grads = {}
    for n, p in model.named_parameters():
        n = n.removeprefix("model.")
        if n.endswith("experts.gate_up_proj"):
            for j in range(experts):
                grads[n.replace("gate_up_proj", f"{j}.gate_proj.weight")] = p.grad[j, :ffn].clone()
                grads[n.replace("gate_up_proj", f"{j}.up_proj.weight")] = p.grad[j, ffn:].clone()
        elif n.endswith("experts.down_proj"):
            for j in range(experts):
                grads[n.replace("down_proj", f"{j}.down_proj.weight")] = p.grad[j].clone()
        else:
            grads[n] = p.grad.clone()
    return logits.detach(), grads


def ours_at_tp(rank, world, init, model_dir, ep=1, etp=None):
    """In a spawned rank: raytp's logits and gradients of the same batch at TP=world (experts over `ep` ranks
    of it, whole on each with `etp` 1), gathered whole (the gradients the step sums over TP summed: shared KV
    heads, routers, q/k norms; each whole expert's from the rank holding it)."""
    model, groups = hf_shard_at_tp(rank, world, init, model_dir, ep, etp)
    x, y = batch()
    logits = comm.gather_last(model(x), groups.tp)[..., :V].detach()
    model(x, y).backward()
    _sum_over_tp([(p, p.grad) for p in model.parameters() if p.grad is not None], groups.tp)
    grads = {}
    whole = [None] * world
    dist.all_gather_object(whole, {n: p.grad for n, p in model.named_parameters()
                                   if getattr(p, "whole_on_rank", False)}, group=groups.tp)
    for part in whole:
        grads.update(part)
    for name, p in model.named_parameters():
        if getattr(p, "whole_on_rank", False):
            continue
        parts = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(parts, p.grad.contiguous(), group=groups.tp)
        grads[name] = unshard_tensors(parts, split_of(name, model.cfg), full_size_of(name, model.cfg))
    return logits, grads


def assert_equal_within(got, want, tol: float = 1e-4) -> None:
    """(logits, gradients) against (logits, gradients), every tensor within `tol`."""
    assert float((got[0] - want[0]).abs().max()) < tol
    assert got[1].keys() == want[1].keys()
    for k, g in want[1].items():
        assert float((got[1][k] - g).abs().max()) < tol, k


def perturbed_and_saved(model, d, seed: int = 3):
    """Norms away from 1, q/k/v biases away from 0 and routers with preferences (so all are tested), then
    `model` saved into `d`: (d, model)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("_proj.bias"):
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    model.save_pretrained(d)
    return d, model


def assert_same_greedy_generation(d, model):
    """raytp's model loaded from directory `d` on one device generates what transformers' `model` does (12
    greedy tokens after a 6-token prompt); returns raytp's config of `d`."""
    from raytp.files.interop import hf
    from raytp.models.registry import build_model
    cfg = hf.inspect(d)
    ours = build_model(cfg, seed=0).eval()
    hf.load_into(d, ours, 0, 1)
    prompt = batch()[0][:1, :6]
    want = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 12, temperature=0.0), want)
    return cfg
