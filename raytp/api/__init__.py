"""raytp from Python: `train` runs a job to its end in this process and returns its `Result`, raising
`BadJob` or `RunFailed` where `raytp train` exits 2 or 1 (with the message it prints after ``error:``).

    import raytp
    result = raytp.train("jobs/default.yaml", overrides={"parallel.tp": 1}, run_dir="runs/try")

errors.py holds the errors, result.py the Result, job.py the checks made before Ray starts, run.py the run.
"""
from raytp.api.errors import BadJob, Interrupted, RunFailed, TrainError
from raytp.api.result import Result
from raytp.api.run import train

__all__ = ["BadJob", "Interrupted", "Result", "RunFailed", "TrainError", "train"]
