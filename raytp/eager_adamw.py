"""torch's AdamW, built and stepped without importing torch._dynamo.

torch.optim's entry points (``add_param_group``, the functional ``adam`` and the step's grad-mode wrapper)
import torch._dynamo on their first call, so that torch.compile can trace around them. That import is ~1.2 s
of CPU in a new process (docs/findings.md), paid by every worker, spare and rank started ahead of a resize,
on the path of a recovery without a spare. raytp never compiles an optimizer: here the same functions run
as the eager code they are, on the same tensors in the same order (the same bits: tests/test_eager_adamw.py).

- ``torch._disable_dynamo`` looks for a ready "disabled" function on the function it wraps before importing
  torch._dynamo to make one; the original function is given as its own, so it is called directly (what
  the disabled one does outside torch.compile).
- The step's wrapper imports torch._dynamo for its graph breaks only; ``step`` calls the step below it, with
  gradients off as that wrapper does (its ``differentiable`` is False) and under the profiler's label.

Where torch's wrappers are not as described (another torch), the optimizer is built and stepped the usual
way: slower to start, never different.
"""
from __future__ import annotations

import torch
from torch.optim import adam as _adam
from torch.optim import optimizer as _optimizer

_DECORATED = (_optimizer.Optimizer.add_param_group, _adam.adam)


def _unwrapped(fn, wrapper_code: str):
    """The function `fn` wraps where `fn` is torch's wrapper of that name, else None."""
    inner = getattr(fn, "__wrapped__", None)
    return inner if inner is not None and fn.__code__.co_name == wrapper_code else None


def _mark_eager() -> None:
    for fn in _DECORATED:
        for code in ("inner", "maybe_fallback"):
            original = _unwrapped(fn, code)
            if original is not None and not hasattr(original, "__dynamo_disable"):
                setattr(original, "__dynamo_disable", original)


def adamw(param_groups: list[dict], **defaults) -> torch.optim.AdamW:
    """torch.optim.AdamW over `param_groups`, built without importing torch._dynamo."""
    _mark_eager()
    return torch.optim.AdamW(param_groups, **defaults)


def _plain_step(cls):
    """`cls.step` below torch's profiler-hook and grad-mode wrappers, or None."""
    hooked = _unwrapped(cls.step, "wrapper")
    return _unwrapped(hooked, "_use_grad") if hooked is not None else None


def _hooked(opt) -> bool:
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or _optimizer._global_optimizer_pre_hooks or _optimizer._global_optimizer_post_hooks)


def step(opt: torch.optim.AdamW) -> None:
    """opt.step(), as eager code: with gradients off, under the profiler's label; where hooks are registered on
    the step, or it is differentiable, torch's own ``opt.step()``."""
    plain = _plain_step(type(opt))
    if plain is None or opt.defaults.get("differentiable") or _hooked(opt):
        opt.step()
        return
    with torch.no_grad(), torch.autograd.profiler.record_function(f"Optimizer.step#{type(opt).__name__}.step"):
        plain(opt)
        opt._optimizer_step_code()
