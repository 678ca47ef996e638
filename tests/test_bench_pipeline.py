"""What the figures of `python -m bench pipeline` rest on: SavedActivations counts what autograd keeps for
backward (each storage once, parameters left out, back to zero once backward has run), and the idle model
its bubble figures are compared with is raytp's schedule simulation, given a time per stage."""
import pytest
import torch

from bench.pipeline_probes import SavedActivations, one_f_one_b_idle
from raytp.parallel.pipeline.pp_schedule import bubble, one_f_one_b, simulate


def test_saved_bytes_count_each_storage_once_and_leave_out_parameters():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(10, 64, requires_grad=True)
    with SavedActivations(lin) as saved:
        h = lin(x)                     # saves x (and the weight: a parameter, not counted)
        assert saved.first_forward == x.numel() * 4
        y = h * h                      # saves h twice: one storage
        z = y.exp()                    # saves its own output
        assert saved.now == saved.peak == (x.numel() + h.numel() + z.numel()) * 4
        z.sum().backward()
        assert saved.now == 0          # autograd dropped them all
    assert saved.peak == (x.numel() + h.numel() + z.numel()) * 4
    assert x.grad is not None and lin.weight.grad is not None  # unpacking gave backward the tensors


def test_peak_tracks_graphs_alive_at_once():
    lin = torch.nn.Linear(16, 16)
    with SavedActivations(lin) as saved:
        first = lin(torch.randn(4, 16, requires_grad=True)).tanh()
        one = saved.now
        second = lin(torch.randn(4, 16, requires_grad=True)).tanh()
        assert saved.now == 2 * one
        first.sum().backward()
        assert saved.now == one
        second.sum().backward()
    assert saved.peak == 2 * one and saved.now == 0


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 4, 8, 32])
def test_idle_model_is_the_schedule_simulation_with_equal_stages(p, m):
    """Equal stages: the idle of raytp.parallel.pipeline.pp_schedule.simulate, which is the formula (p-1)/(m+p-1)."""
    timeline = simulate(one_f_one_b(p, m), p, t_f=1.0, t_b=2.0)
    got = one_f_one_b_idle((1.0,) * p, (2.0,) * p, m)
    assert got == pytest.approx([timeline.idle(s) for s in range(p)], abs=1e-12)
    assert got == pytest.approx([bubble(p, m)] * p, abs=1e-12)


def test_idle_model_with_unequal_stages():
    """Stage 1 twice as slow as stage 0. m = 1: the micro-batch runs through in turn (F on 0, F on 1, B on 1,
    B on 0), each stage idle while the other works; m = 2 worked out by hand below."""
    assert one_f_one_b_idle((1.0, 2.0), (2.0, 4.0), 1) == pytest.approx([1 - 3 / 9, 1 - 6 / 9])
    # m = 2: stage 0 F0 [0,1] F1 [1,2]; stage 1 F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13]; stage 0 B0 [7,9] B1 [13,15]
    assert one_f_one_b_idle((1.0, 2.0), (2.0, 4.0), 2) == pytest.approx([1 - 6 / 15, 1 - 12 / 15])
