"""The elastic room: the two-phase resize protocol and the records a running job carries (resize.py), and moving the state to another layout (reshard.py)."""
