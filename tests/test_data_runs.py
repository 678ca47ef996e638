"""Ray runs on prepared datasets: a blend of two raytp prepared datasets with document masking trains through
the runtime (data_s reported each step), and recovers bitwise after a SIGKILL."""
import dataclasses
import json
import signal

import pytest

from helpers import RECOVERY_STEPS, assert_bitwise_equal, events, final_state, recovery_job, run, signal_rank
from offline import write_prepared
from raytp.api.job import check_data
from raytp.config import validate
@pytest.fixture(scope="module")
def blended(ray_local, tmp_path_factory):
    """(job, final state, run dir) of an uninterrupted TP=2 run on a masked 0.7/0.3 blend."""
    data = tmp_path_factory.mktemp("data")
    mix = {write_prepared(data / "web", 0, 0, 128): 0.7, write_prepared(data / "code", 1, 128, 255): 0.3}
    cfg = recovery_job(2, 1)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, mix=mix, document_mask=True))
    validate(cfg)
    run_dir = tmp_path_factory.mktemp("blend") / "run"
    run(cfg, run_dir, "blend")
    return cfg, final_state(run_dir), run_dir


def test_a_masked_blend_of_prepared_datasets_trains(blended):
    cfg, _, run_dir = blended
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(RECOVERY_STEPS))
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(0 < r["data_s"] < r["step_time_s"] for r in records)
    # epochs read: of the source read faster than its size (code: 0.3 of the samples, ~half the windows)
    from raytp.data.corpus import job_corpus
    corpus = job_corpus(cfg.data)
    windows = corpus.windows("train", cfg.model.block_size)
    expected = max(0.7 * RECOVERY_STEPS * 8 / windows[0], 0.3 * RECOVERY_STEPS * 8 / windows[1])
    assert records[-1]["epoch"] == pytest.approx(expected, rel=1e-5)

    said, conversations = check_data(cfg)  # what the start line says the data is
    assert said.startswith("0.7 x prepared dataset") and "; 0.3 x prepared dataset" in said and not conversations


@pytest.mark.slow
def test_a_run_on_prepared_datasets_recovers_bitwise_after_sigkill(blended, tmp_path):
    cfg, reference, _ = blended
    run_dir = tmp_path / "run"
    run(cfg, run_dir, "blendkill", faults=[(5, signal_rank(1, signal.SIGKILL))])
    fails = events(run_dir, "failure")
    assert len(fails) == 1, fails
    (fail,) = fails
    assert fail["rank"] == 1 and fail["cause"] == "died"
    assert_bitwise_equal(final_state(run_dir), reference)
