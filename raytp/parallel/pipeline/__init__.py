"""Pipeline parallelism, knowing no model: schedules as pure action tables (pp_schedule.py), layers per stage
by cost (pp_split.py), activations and gradients between stages (p2p.py)."""
