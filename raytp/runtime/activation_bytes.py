"""The bytes a transformer layer keeps for its backward pass, per token of one micro-batch (the memory estimate's
activations: raytp.runtime.estimate).

- GPT-2: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 2
  with tensor parallelism): h (10 + 24/t) bytes in half precision, h 34/t with sequence parallelism, doubled
  in float32; plus the attention scores' 5 a s / t where they are materialised (an explicit attention: GPT-2's
  dropout in training, or a document mask on CPU), not under SDPA's fused kernels, which keep q, k, v and
  the output only.
- Llama (raytp.models.llama.model), counted from what its autograd graph saves, e bytes a value in the
  compute dtype (2 under bf16 autocast, 4 in float32):
  - each RMSNorm, its float32 input and normalised output (8h; /t under SP);
  - attention: the projections' input (e h, whole: gathered under SP), q, k and v as SDPA reads them (k
    and v repeated to the query heads), its output and o_proj's input (5 e q / t, q = n_head x head width);
  - a dense MLP: its input (e h) and the SwiGLU's four F-wide tensors (4 e F / t);
  - an expert layer: its input (e h), and per expert a token reaches, its dispatched copy, the expert's
    output and its weighted output (3 e h) and the SwiGLU's four F-wide tensors (4 e F / t, the experts
    split over TP; each TP rank a 1/t share of the tokens where experts are whole, etp 1); shared experts
    as a dense MLP of their width.
  Measured (bench/gpu_check on an H200, bf16: a 1.1B Llama 0.96x of the whole estimate's peak allocation,
  an 8-layer MoE Llama 0.98x; bench/moe_memory on CPU, float32: the RSS slope per token 0.9x).
"""
from __future__ import annotations


def materialised_attention(cfg) -> bool:
    """Whether attention keeps its (s x s) scores for the backward pass: an explicit attention (GPT-2 with
    dropout in training) or SDPA with a document mask on CPU (no fused kernel takes the mask there)."""
    explicit = cfg.model.arch != "llama" and cfg.model.dropout > 0
    return explicit or (cfg.data.document_mask and cfg.runtime.device == "cpu")


def gpt2_layer(cfg, tp: int) -> float:
    m, sp = cfg.model, cfg.parallel.sequence_parallel
    s, h, a = m.block_size, m.n_embd, m.n_head
    per_token = h * (34 / tp if sp else 10 + 24 / tp)
    if materialised_attention(cfg):
        per_token += 5 * a * s / tp
    return per_token * (2 if cfg.train.precision == "fp32" else 1)


def llama_layer(cfg, model_cfg, layer: int, tp: int) -> float:
    """Bytes per token layer `layer` of a Llama-family model keeps (see the module's doc)."""
    sp, etp = cfg.parallel.sequence_parallel, cfg.parallel.etp
    e = 4 if cfg.train.precision == "fp32" else 2
    h, q, m = model_cfg.n_embd, model_cfg.n_head * model_cfg.head_width, model_cfg.moe
    norms = 2 * 8 * h / (tp if sp else 1)
    attn = e * h + 5 * e * q / tp
    if materialised_attention(cfg):  # QK^T and its softmax, per head
        attn += 2 * e * model_cfg.n_head * cfg.model.block_size / tp
    if m is not None and m.is_moe(layer):
        whole = etp == 1 and tp > 1  # each TP rank routes its 1/tp of the tokens to whole experts
        routed = m.top_k * (3 * h + 4 * m.moe_ffn / (1 if whole else tp)) / (tp if whole else 1)
        mlp = e * (h + routed + (4 * m.shared_width / tp if m.shared_width else 0))
    else:
        mlp = e * (h + 4 * model_cfg.mlp_width / tp)
    return norms + attn + mlp
