"""The distributed optimizer with experts held by an expert-DP group of more than one rank, through the runtime
(the MoE Llama of tests/test_moe_ep_runtime.py): each rank keeps its rows of its experts' AdamW state and writes
them to its own file, a killed rank comes back from its snapshot bit for bit, and the checkpoint moves between
such layouts and to one device."""
import dataclasses
import json
import signal

import numpy as np
import pytest

from helpers import EP_STEPS as STEPS
from helpers import assert_bitwise_equal, ep_job, events, final_state, losses, resume_run, run, signal_rank
from reference_runs import unbroken_run
from raytp.files import checkpoint


@pytest.mark.slow
def test_zero1_cuts_expert_state_over_expert_dp_and_its_checkpoints_move(ray_local, tmp_path):
    """TP=1 x DP=4 x EP=2 under zero 1: ranks 0 and 2 hold experts 0-1 (an expert-DP group of two), and each keeps
    its rows of their AdamW state and writes them to its own file; a SIGKILLed rank comes back from its snapshot
    bit for bit; the step-4 checkpoint resumes at TP=2 x DP=2 x
    EP=2 with whole experts on each TP rank (etp 1, zero 1: the state cut over a group of two other ranks, each
    block naming its TP file), whose step-6 checkpoint resumes on one device, each tracking the unbroken run."""
    # The unbroken run, in forked ranks (tests/reference_runs.py: bit for bit a Ray run's; it trains like one
    # device: tests/test_moe_ep.py); its checkpoints are the workers' own files, committed as the driver does.
    unbroken_run(ep_job(1, 4, 2, zero=1), tmp_path / "dp4", "ep4cut")
    theirs = np.array(losses(tmp_path / "dp4"))
    assert len(theirs) == STEPS
    # rank 2, SIGKILLed after step 3, holds rows no other rank does: back from its snapshot, bit for bit
    run(ep_job(1, 4, 2, zero=1), tmp_path / "kill", "ep4cutkill", faults=[(3, signal_rank(2, signal.SIGKILL))])
    (rec,) = events(tmp_path / "kill", "recovered")
    assert rec["source"] == "snapshot", rec
    assert_bitwise_equal(final_state(tmp_path / "kill", STEPS), final_state(tmp_path / "dp4", STEPS))
    m = json.loads((tmp_path / "dp4" / "checkpoints" / checkpoint.step_dir(4) / "manifest.json").read_text())
    for held, files in (((0, 1), {0, 2}), ((2, 3), {1, 3})):  # the experts' rows, cut over their two holders
        entries = [e for k, e in m["tensors"].items() if k.endswith("/exp_avg") and ".experts." in k
                   and int(k.split(".")[4]) in held]
        assert {b[0] for e in entries for b in e["blocks"]} == files
        for e in entries:  # every row of each in one block
            rows = sorted((b[1], b[2]) for b in e["blocks"])
            assert rows[0][0] == 0 and rows[-1][1] == e["shape"][0] and all(
                a[1] == b[0] for a, b in zip(rows, rows[1:])), e
    etp1 = ep_job(2, 2, 2, etp=1, zero=1)
    etp1 = dataclasses.replace(etp1, checkpoint=dataclasses.replace(etp1.checkpoint, every=2))
    resume_run(etp1, tmp_path / "dp4" / "checkpoints" / checkpoint.step_dir(4), tmp_path / "etp1", "ep2cut")
    ours = np.array(losses(tmp_path / "etp1"))
    assert len(ours) == STEPS - 4 and (np.abs(ours - theirs[4:]) / theirs[4:]).max() < 1e-4
    m = json.loads((tmp_path / "etp1" / "checkpoints" / checkpoint.step_dir(6) / "manifest.json").read_text())
    entries = [e for k, e in m["tensors"].items() if k.endswith("/exp_avg") and ".experts.0." in k]
    assert all(e["tp"] == 1 for e in entries)
    assert len({(b[0], b[3]) for e in entries for b in e["blocks"]}) == 2  # two ranks' files (dp, tp_file)
    resume_run(ep_job(1, 1, 1), tmp_path / "etp1" / "checkpoints" / checkpoint.step_dir(6), tmp_path / "one", "ep1cut")
    one = np.array(losses(tmp_path / "one"))
    assert len(one) == STEPS - 6 and (np.abs(one - theirs[6:]) / theirs[6:]).max() < 1e-4

