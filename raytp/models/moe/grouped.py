"""How a rank runs its local experts on the rows sent to them: one grouped GEMM per projection
(``torch._grouped_mm``: every expert's rows in one call, offsets between them) where the device and the
compute dtype support it, else one expert after another.

The choice is made once per (device type, dtype) by a small probe against the loop (``grouped_works``) and
named by ``expert_kernel``: grouped on an accelerator where the probe passes; on CPU the loop, which measured
faster there (a whole layer, D=256, F=512, 8 experts, 4096 rows, float32: 87 ms looped, 93 ms grouped: the
weights' stacking costs more than one call saves). The grouped path stacks the experts' weights (cast to the
compute dtype, as autocast's cache would hold them) for the duration of the step; its results equal the
loop's bit for bit on CPU (float32 and bfloat16, tested there by choosing it), so a layout computes the same
whichever path runs.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_MM = getattr(torch, "_grouped_mm", None)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on, else the rows'."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


@functools.lru_cache(maxsize=None)
def grouped_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here, forward and backward, and equals a loop of matmuls (a probe of
    three groups, one empty, on the first device of that type)."""
    if _MM is None:
        return False
    try:
        device = torch.device(device_type)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 32, generator=g).to(device, dtype).requires_grad_()
        w = torch.randn(3, 32, 16, generator=g).to(device, dtype).requires_grad_()
        offs = torch.tensor([16, 16, 48], dtype=torch.int32, device=device)
        with torch.autocast(device_type, enabled=False):
            y = _MM(x, w, offs=offs)
            y.backward(torch.ones_like(y))
            want = torch.cat([x[:16] @ w[0], x[16:48] @ w[2]])
        return bool(torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2)) and w.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def use_grouped(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the experts run grouped here: on an accelerator where the probe passes (not on CPU, where the
    loop measured faster)."""
    return device_type != "cpu" and grouped_works(device_type, dtype)


def expert_kernel(device_type: str, dtype: torch.dtype) -> str:
    """The words for the start line: which path the experts take here."""
    return "grouped GEMM (torch._grouped_mm)" if use_grouped(device_type, dtype) else "one expert at a time"


def run_experts(rows: torch.Tensor, sizes: list[int], experts: list) -> torch.Tensor:
    """`rows` (sum(sizes), C), the first sizes[0] for experts[0] and so on -> each row through its SwiGLU
    expert (raytp.models.moe.layer.Expert), in the same order."""
    dtype = compute_dtype(rows)
    if not experts or rows.shape[0] == 0 or not use_grouped(rows.device.type, dtype):
        outs, at = [], 0
        for e, n in zip(experts, sizes):
            outs.append(e(rows[at:at + n]))
            at += n
        return torch.cat(outs) if outs else rows
    offs = torch.tensor(sizes, device=rows.device).cumsum(0).to(torch.int32)

    def stacked(leaf: str) -> torch.Tensor:  # (E, in, out): each expert's weight, transposed as F.linear reads it;
        # cast before stacking: the one copy stacked is in the compute dtype (half the bytes under bf16)
        return torch.stack([getattr(e, leaf).weight.to(dtype) for e in experts]).transpose(-2, -1)

    with torch.autocast(rows.device.type, enabled=False):
        x = rows.to(dtype)
        h = F.silu(_MM(x, stacked("gate_proj"), offs=offs)) * _MM(x, stacked("up_proj"), offs=offs)
        return _MM(h, stacked("down_proj"), offs=offs)
