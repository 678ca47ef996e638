"""The cluster room: a WorkerGroup, the workers of one layout as a value (group.py) and its state in and
out (group_state.py), placement groups (placement.py), starting actors (launch.py), carving a layout out of
held bundles (slots.py), the streamed step calls (streaming.py) and their relay (relay.py), health."""
