"""A job in the terms of the layers below the runtime: the model's shape, the optimiser's knobs."""
from __future__ import annotations

from raytp.config.schema import JobConfig
from raytp.models.args import ModelArgs
from raytp.train.hyper import Hyper


def model_args(cfg: JobConfig) -> ModelArgs:
    m = cfg.model
    return ModelArgs(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, block_size=m.block_size,
                     vocab_size=m.vocab_size, dropout=m.dropout, arch=m.arch, n_kv_head=m.n_kv_head,
                     intermediate_size=m.intermediate_size, rope_theta=m.rope_theta,
                     tie_embeddings=m.tie_embeddings, norm_eps=m.norm_eps, rope_scaling=m.rope_scaling,
                     moe=m.moe, head_dim=m.head_dim, qk_norm=m.qk_norm,
                     qkv_bias=m.qkv_bias)


def hyper(cfg: JobConfig) -> Hyper:
    t = cfg.train
    return Hyper(lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, steps=t.steps, lr_schedule=t.lr_schedule,
                 weight_decay=t.weight_decay, beta1=t.beta1, beta2=t.beta2, grad_clip=t.grad_clip, seed=t.seed,
                 precision=t.precision)
