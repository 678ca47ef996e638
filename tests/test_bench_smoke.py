"""The benchmark entry points run at a tiny size (`python -m bench --quick`) and
write their figures, merged, to the results file. No timing is asserted."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_quick_run_writes_figures_and_keeps_other_entries(tmp_path):
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"someone_elses": {"peer": "x", "figure": 1}}))
    proc = run_bench("tp_vs_dtensor", "tp_memory", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["someone_elses"] == {"peer": "x", "figure": 1}  # merged, not replaced
    assert not out.with_name(out.name + ".tmp").exists()

    tp = results["tp_vs_dtensor"]
    assert tp["peer"] and tp["quick"] is True
    fig = tp["tp2"]
    for key in ("raytp_median_step_s", "dtensor_median_step_s", "raytp_compute_only_median_step_s",
                "ratio_raytp_over_dtensor", "paired_ratio_median"):
        assert fig[key] > 0, key
    assert fig["timed_steps_each"] >= 2
    # the same model in both: the first losses agree
    first = fig["first_losses"]
    assert len(first["raytp"]) == len(first["dtensor"]) >= 2
    assert all(abs(a - b) < 1e-4 for a, b in zip(first["raytp"], first["dtensor"]))
    counts = fig["collectives_per_step"]
    assert counts["raytp"].get("all_reduce", 0) > 0 and counts["dtensor"].get("all_reduce", 0) > 0
    assert counts["raytp"] == fig["dist_api_calls_per_step"]["raytp"]  # the two counters agree for raytp
    # parallel.tp_overlap: raytp's entry collectives ran behind compute; with it off none did
    assert fig["raytp_comm_hidden_s"] > 0 and fig["raytp_no_overlap_comm_hidden_s"] == 0
    assert fig["raytp_no_overlap_median_step_s"] > 0 and fig["raytp_comm_exposed_s"] > 0

    mem = results["tp_memory"]
    assert mem["peer"]
    m2 = mem["tp2"]
    assert m2["raytp_bytes"] > 0 and m2["ideal_bytes"] > 0 and m2["dtensor_bytes"] > 0
    assert m2["ratio_raytp_over_ideal"] == round(m2["raytp_bytes"] / m2["ideal_bytes"], 4)
    assert m2["ideal_bytes"] < m2["full_model_bytes"]

    assert "tp_vs_dtensor" in proc.stdout and "tp_memory" in proc.stdout  # the table


def test_unknown_benchmark_is_rejected(tmp_path):
    proc = run_bench("no_such_bench", "--out", str(tmp_path / "r.json"), timeout=60)
    assert proc.returncode != 0 and "no_such_bench" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_registry_lists_both():
    proc = run_bench("--list", timeout=60)
    assert proc.returncode == 0
    assert {"tp_vs_dtensor", "tp_memory"} <= set(proc.stdout.split())


@pytest.mark.slow
def test_checkpoint_io_quick(tmp_path):
    """raytp's worker-written checkpoints against DCP at the tiny size: every figure is there, and the TP=2
    load of the TP=4 files fits. The Ray benchmarks (ray_overhead, recovery, snapshots, resize,
    memory_scale) take minutes even when quick: they are run with `python -m bench`, not here."""
    out = tmp_path / "results.json"
    proc = run_bench("checkpoint_io", "--quick", "--out", str(out), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    ck = results["checkpoint_io"]
    assert ck["peer"] and ck["quick"] is True
    for key in ("dcp_save_s", "raytp_load_reshard_s", "dcp_load_reshard_s", "ratio_load_to_dcp",
                "raytp_files_gb", "dcp_files_gb"):
        assert ck[key] > 0, key
    assert ck["ratio_pause_to_dcp_save"] > 0 and ck["raytp_load_checked"] is True


@pytest.mark.slow  # a benchmark run: ~12 s
def test_moe_quick_run_measures_both_layouts_and_the_rows_its_all_to_all_moves(tmp_path):
    """bench/moe at its tiny size: raytp's layer timed at EP=1 and EP=2 (fp32 and bf16); its all-to-all moves
    tokens x k rows each way, about half of them to the other rank (torchtitan compared where installed, at
    both: outputs equal to bf16 rounding). What its ranks hold (weights, gradients with their reductions'
    buffers, AdamW) is the memory estimate's figure, within 10%, at each layout."""
    out = tmp_path / "results.json"
    proc = run_bench("moe", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(out.read_text())["moe"]
    assert fig["peer"] and fig["ep1"]["raytp_ms"] > 0 and fig["ep1"]["raytp_bf16_ms"] > 0
    s = fig["size"]
    assert fig["ep2"]["rows_each_way"] == s["tokens"] * s["K"] and fig["ep2"]["raytp_ms"] > 0
    assert 0 < fig["ep2"]["crossing_rows"] < fig["ep2"]["rows_each_way"]
    if "torchtitan_ms" in fig["ep1"]:
        assert fig["ep1"]["out_diff_bf16_vs_torchtitan"] < 1e-3  # both route in float32, experts in bf16
        assert fig["ep2"]["out_diff_bf16_vs_torchtitan"] < 1e-3
    else:
        assert fig["ep2"]["torchtitan"] == "not installed"
    memory = {k: v for k, v in fig["memory"].items() if isinstance(v, dict) and "state_over_estimate" in v}
    assert len(memory) == 4 and fig["memory"]["within_goal"], fig["memory"]
    assert all(0.9 <= v["state_over_estimate"] <= 1.1 and v["rss_growth_bytes"] > 0 for v in memory.values())


def test_prepare_chat_s_work_alone_runs_on_a_few_rows(tmp_path, monkeypatch):
    """bench/prepare_chat's in-process part (raytp's encoding against apply_chat_template, no Ray) on a few rows:
    its full run starts Ray (15 s), so nothing else here would notice a helper it calls moving away (a refactor
    broke it so once). Both rates are measured (no timing is asserted)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.prepare_chat import one_process
    from raytp.data.chat_demo import conversations, tokenizer_dir
    rates = one_process(tokenizer_dir(tmp_path / "tok"), conversations(20, seed=1))
    assert set(rates) == {"raytp", "peer"} and all(v > 0 for v in rates.values())
