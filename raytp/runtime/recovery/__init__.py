"""The recovery room: healing lost workers (detect, replace, restore, rewire: recovery.py), getting survivors out of a
failed step (leaving.py) and warm spares (spares.py)."""
