"""Efficiency figures (raytp.train.efficiency): the FLOPs formula against torch's own FLOP counter on the
one-device models, the peak table, MFU; no processes."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from raytp.models.args import ModelArgs
from raytp.models.registry import build_model
from raytp.train.efficiency import flops_per_token, peak_memory, peak_tflops, step_figures

MODELS = {
    "gpt2": ModelArgs(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=512),
    "llama-gqa": ModelArgs(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=160,
                           block_size=32, vocab_size=512),
    "llama-tied": ModelArgs(arch="llama", n_layer=3, n_head=4, n_embd=64, intermediate_size=96, block_size=16,
                            vocab_size=300, tie_embeddings=True),
    # An expert layer counts what a token goes through: the router, its 2 of 4 experts, the gated shared one.
    "llama-moe": ModelArgs(arch="llama", n_layer=3, n_head=4, n_embd=64, intermediate_size=96, block_size=16,
                           vocab_size=300, moe=dict(n_experts=4, top_k=2, moe_ffn=32, first_dense=1, n_shared=1,
                                                    shared_ffn=48, shared_gate=True)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_flops_per_token_equal_torchs_count_of_a_training_step(name):
    """Every matmul of the forward and backward passes, attention's included (the math SDPA kernel, which the
    counter sees as bmm; it counts causal attention whole, as the formula does)."""
    cfg = MODELS[name]
    model = build_model(cfg, 1)
    x = torch.randint(0, cfg.vocab_size, (3, cfg.block_size))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, torch.roll(x, -1, 1)).backward()
    assert counter.get_total_flops() == flops_per_token(cfg) * x.numel()


def test_peak_table_override_and_mfu():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA L40S") == 362.0 and peak_tflops("NVIDIA L4") == 121.0
    assert peak_tflops(None) is None and peak_tflops("cpu") is None
    assert peak_tflops("some new GPU", override=500.0) == 500.0
    cfg = MODELS["gpt2"]
    tokens_per_s = 1e15 / flops_per_token(cfg)  # one PFLOP/s over 2 devices: 500 TFLOP/s each
    fig = step_figures(cfg, tokens_per_s, devices=2, peak=1000.0)
    assert fig["tflops"] == pytest.approx(500.0) and fig["mfu"] == pytest.approx(0.5)
    assert step_figures(cfg, tokens_per_s, devices=2, peak=None)["mfu"] is None


def test_peak_memory_of_this_process_is_its_resident_peak_on_cpu():
    before = peak_memory(torch.device("cpu"))["peak_mem_bytes"]
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = peak_memory(torch.device("cpu"))["peak_mem_bytes"]
    assert after >= before and after >= block.numel() * 4
