"""The state room: a group's checkpoints (saving, committing, restoring: checkpoints.py) and in-memory snapshots with their cadence and off-node copy (snapshots.py)."""
