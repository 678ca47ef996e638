"""What the expert layers did in a step, for its record: per MoE layer, the tokens each expert got over the
whole global batch (min, max, and max/mean: 1.0 is a perfect balance, E / k is every token on the same k
experts), the balance and z losses (means over the step's forwards and DP replicas), and the choices dropped
past the experts' capacity (0 when dropless).

Gathered onto the first stage in two small all-reduces, over DP (replicas route different tokens) and over
the pipeline's stages (each holds some of the layers); TP ranks route the same tokens and are not summed.
Every rank of a model with expert layers calls it once per step. ``balance_biases`` is what a sigmoid
router's loss-free balancing does with the same counts, inside the step.
"""
from __future__ import annotations

from typing import Callable

import torch

from raytp.models.moe.layer import MoE
from raytp.models.moe.routing import balance_bias
from raytp.parallel import comm
from raytp.parallel.groups import ProcessGroups


def expert_figures(model: torch.nn.Module, groups: ProcessGroups) -> dict:
    """{"experts": {layer: {"min", "max", "imbalance", "balance_loss", "z_loss", "dropped"}}, "expert_imbalance": the
    worst layer's, "balance_loss" and "z_loss": summed over the layers}, complete on the first stage ({} for a
    model without expert layers)."""
    cfg = model.cfg
    if cfg.moe is None:
        return {}
    ids = [i for i in range(cfg.n_layer) if cfg.moe.is_moe(i)]
    E = cfg.moe.n_experts
    buf = torch.zeros(len(ids), E + 4, dtype=torch.float64)  # per expert, balance sum, z sum, forwards, dropped
    for key, block in model.block_dict().items():
        if isinstance(block.mlp, MoE):
            load, balance, z, forwards, dropped = block.mlp.stats.take(E)
            buf[ids.index(int(key))] = torch.cat([load.double().cpu(),
                                                  torch.tensor([balance, z, forwards, dropped], dtype=torch.float64)])
    device = next(model.parameters()).device
    buf = buf.to(device)
    for axis in ("dp", "pp"):
        if groups.group(axis) is not None:
            comm.all_reduce(buf, groups.group(axis))
    buf = buf.cpu()
    layers = {}
    for i, row in zip(ids, buf):
        load, forwards = row[:E], max(float(row[E + 2]), 1.0)
        mean = float(load.mean())
        layers[str(i)] = {"min": int(load.min()), "max": int(load.max()),
                          "imbalance": float(load.max()) / mean if mean else 0.0,
                          "balance_loss": float(row[E]) / forwards, "z_loss": float(row[E + 1]) / forwards,
                          "dropped": int(row[E + 3])}
    return {"experts": layers, "expert_imbalance": max(v["imbalance"] for v in layers.values()),
            "balance_loss": sum(v["balance_loss"] for v in layers.values()),
            "z_loss": sum(v["z_loss"] for v in layers.values())}


def balance_biases(model: torch.nn.Module, groups: ProcessGroups) -> Callable[[], None]:
    """Sum each expert layer's choices per expert over every DP replica and CP rank (one all-reduce for all its
    layers); the returned call moves each selection bias toward balance by them (raytp.models.moe.routing.balance_bias).
    The move is the step's update, made with the optimizer's: no state changes while a collective of the step
    can still fail. Every rank of the stage calls it once per step, with the same result (TP ranks route the
    same tokens)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.args.bias_rate]
    if not layers:
        return lambda: None
    E = layers[0].args.n_experts
    loads = torch.stack([m.step_load if m.step_load is not None else torch.zeros(E, dtype=torch.long,
                                                                                device=m.expert_bias.device)
                         for m in layers]).to(torch.float64)
    if groups.grad is not None:  # every replica's, and every CP rank's part of the sequences
        comm.all_reduce(loads, groups.grad)

    @torch.no_grad()
    def move() -> None:
        for m, load in zip(layers, loads):
            balance_bias(m.expert_bias.data, load, m.args.bias_rate)
            m.step_load = None
    return move
