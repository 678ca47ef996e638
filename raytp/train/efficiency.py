"""Efficiency figures of a training step: model FLOPs per token, TFLOP/s per device, MFU, and the memory a
worker process has used at its peak. Pure functions, but ``peak_memory`` (which reads the process).

FLOPs per token (torchtitan's and PaLM's count): a matmul of a weight with N elements costs 2N FLOPs per
token forward and 4N backward, so a training step costs 6 x the matmul weights (every parameter but the
token and position embeddings, which are looked up; a tied head counts once more as the head's matmul; of an
expert layer, the active parameters only: the router and the k experts and shared experts a token reaches);
attention adds, per layer, QK^T and AV over the whole context: 2 x 2 x T x d forward, x 3 with the
backward (12 x n_layer x d x T; causal masking is not subtracted, as in those counts). Checked against
``torch.utils.flop_counter`` on the one-device model (tests/test_efficiency.py).

MFU = achieved FLOP/s per device / the device's peak dense bf16 FLOP/s (from ``PEAK_TFLOPS`` by device
name, or the job's ``runtime.peak_tflops``); None on a CPU or an unknown device without the override.
"""
from __future__ import annotations

import resource

from raytp.models.args import ModelArgs

# Dense bf16 tensor-core peaks (TFLOP/s), by a substring of torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS = (
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
    ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0), ("MI300X", 1307.0), ("MI250X", 383.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("A6000", 155.0), ("V100", 125.0), ("T4", 65.0),
)


def matmul_params(cfg: ModelArgs) -> int:
    """Elements of the weights used in matmuls per token (a tied head counted as the head; an expert layer's
    active ones)."""
    d, layers = cfg.n_embd, cfg.n_layer
    if cfg.arch == "llama":
        kv, q = cfg.kv_heads * cfg.head_width, cfg.n_head * cfg.head_width
        per_layer = [d * q + 2 * d * kv + q * d + 3 * d * cfg.mlp_width] * layers
        m = cfg.moe
        if m is not None:  # an expert layer: the router, and the k experts and shared ones a token goes through
            active = d * m.n_experts + 3 * d * (m.top_k * m.moe_ffn + m.shared_width) + (d if m.shared_gate else 0)
            per_layer = [p - 3 * d * cfg.mlp_width + active if m.is_moe(i) else p for i, p in enumerate(per_layer)]
    else:  # GPT-2: qkv, projection, the 4x MLP (biases are not matmuls)
        per_layer = [3 * d * d + d * d + 2 * d * cfg.mlp_width] * layers
    return sum(per_layer) + d * cfg.vocab_size


def flops_per_token(cfg: ModelArgs, seq_len: int | None = None) -> float:
    """Training FLOPs (forward and backward) per token at context `seq_len` (the model's block size)."""
    t = cfg.block_size if seq_len is None else seq_len
    width = cfg.n_head * cfg.head_width if cfg.arch == "llama" else cfg.n_embd  # attention's q.k and a.v width
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layer * width * t


def peak_tflops(device_name: str | None, override: float | None = None) -> float | None:
    """The peak dense bf16 TFLOP/s of one device: `override` if given, else the table's, else None."""
    if override:
        return float(override)
    if not device_name:
        return None
    for key, tflops in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def step_figures(cfg: ModelArgs, tokens_per_s: float, devices: int, peak: float | None) -> dict:
    """{"tflops", "mfu"} of a step that trained `tokens_per_s` on `devices` devices."""
    tflops = flops_per_token(cfg) * tokens_per_s / devices / 1e12
    return {"tflops": tflops, "mfu": tflops / peak if peak else None}


def peak_memory(device) -> dict:
    """This process's peak memory so far: {"peak_mem_bytes", and on cuda "alloc_retries"}: the CUDA caching
    allocator's peak reserved bytes on a GPU (reset per step by the caller), the resident peak on a CPU."""
    import torch
    if getattr(device, "type", device) == "cuda":
        stats = torch.cuda.memory_stats()
        return {"peak_mem_bytes": int(torch.cuda.max_memory_reserved()),
                "alloc_retries": int(stats.get("num_alloc_retries", 0))}
    return {"peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
