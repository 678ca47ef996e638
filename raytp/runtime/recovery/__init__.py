"""The recovery room: healing lost workers (detect, replace, restore, rewire: recovery.py) and warm spares (spares.py)."""
