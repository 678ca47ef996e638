"""Where the Driver of a run joined to a cluster runs: its coordinator actor (actor.py) and the output its
clients read (lines.py)."""
