"""The elastic room: a layout change as a plan (changes.py: which ranks it keeps and starts, rank_plans.py),
carried out by one protocol (resize.py: reserve, start ahead, switch at a step boundary), and moving the
state to the new layout (reshard.py)."""
