"""How a rank runs its local experts on the rows sent to them: one grouped GEMM per projection
(``torch._grouped_mm``: every expert's rows in one call, offsets between them) where the device and the
compute dtype support it, else one expert after another.

A shard's local experts keep each projection's weights back to back in one buffer (``pack``: each expert's
parameter a view of its slot), so that the grouped GEMM reads them as one (E, out, in) tensor without stacking
a copy every forward (``_Stacked``; where a resize or a load left them apart, they are stacked as before).

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
import torch.nn as nn
import torch.nn.functional as F

_MM = getattr(torch, "_grouped_mm", None)
LEAVES = ("gate_proj", "up_proj", "down_proj")  # an expert's projections (raytp.models.moe.layer.Expert)


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


def run_experts(rows: torch.Tensor, sizes, experts: list) -> torch.Tensor:
    """`rows` (sum(sizes), C), the first sizes[0] for experts[0] and so on -> each row through its SwiGLU
    expert (raytp.models.moe.layer.Expert), in the same order. `sizes`: a list, or a tensor, which the grouped
    GEMM reads where it is (no host sync) and the loop reads on the host."""
    dtype = compute_dtype(rows)
    if not experts or rows.shape[0] == 0 or not use_grouped(rows.device.type, dtype):
        sizes = sizes.tolist() if torch.is_tensor(sizes) else sizes
        outs, at = [], 0
        for e, n in zip(experts, sizes):
            outs.append(e(rows[at:at + n]))
            at += n
        return torch.cat(outs) if outs else rows
    offs = torch.as_tensor(sizes, device=rows.device).cumsum(0).to(torch.int32)

    def stacked(leaf: str) -> torch.Tensor:  # (E, in, out): each expert's weight, transposed as F.linear reads it
        ws = [getattr(e, leaf).weight for e in experts]
        if back_to_back(ws):  # packed: read in place, cast once
            return _Stacked.apply(*ws).to(dtype).transpose(-2, -1)
        # cast before stacking: the one copy stacked is in the compute dtype (half the bytes under bf16)
        return torch.stack([w.to(dtype) for w in ws]).transpose(-2, -1)

    with torch.autocast(rows.device.type, enabled=False):
        x = rows.to(dtype)
        h = F.silu(_MM(x, stacked("gate_proj"), offs=offs)) * _MM(x, stacked("up_proj"), offs=offs)
        return _MM(h, stacked("down_proj"), offs=offs)



def pack(experts: list) -> None:
    """Lay each projection's weights of `experts` (in order) back to back in one buffer, each expert's parameter
    becoming a view of its slot with the same values and attributes."""
    if len(experts) < 2:
        return
    for leaf in LEAVES:
        ws = [getattr(e, leaf).weight for e in experts]
        if len({(tuple(w.shape), w.dtype, w.device) for w in ws}) != 1 or back_to_back(ws):
            continue
        buf = torch.empty((len(ws),) + tuple(ws[0].shape), dtype=ws[0].dtype, device=ws[0].device)
        for j, (e, w) in enumerate(zip(experts, ws)):
            with torch.no_grad():
                buf[j].copy_(w)
            p = nn.Parameter(buf[j], requires_grad=w.requires_grad)
            p.__dict__.update(w.__dict__)  # its tags (whole_on_rank, ...)
            getattr(e, leaf).weight = p


def back_to_back(ws: list[torch.Tensor]) -> bool:
    """Whether tensors `ws` of one shape lie one after the other in one storage (``pack``'s layout)."""
    w0, n = ws[0], ws[0].numel()
    ptr = w0.untyped_storage().data_ptr()
    return all(w.shape == w0.shape and w.is_contiguous() and w.untyped_storage().data_ptr() == ptr
               and w.storage_offset() == w0.storage_offset() + j * n for j, w in enumerate(ws))


class _Stacked(torch.autograd.Function):
    """The (E, out, in) tensor over packed weights `ws` (their storage, no copy); its gradient goes back to each
    weight as its slot of the stacked gradient."""

    @staticmethod
    def forward(ctx, *ws):
        w0 = ws[0]
        return w0.new_empty(0).set_(w0.untyped_storage(), w0.storage_offset(), (len(ws),) + tuple(w0.shape),
                                    (w0.numel(),) + tuple(w0.stride()))

    @staticmethod
    def backward(ctx, g):
        return tuple(g.unbind(0))
