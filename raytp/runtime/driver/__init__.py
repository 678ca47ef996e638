"""The driver's room: the Driver state machine (driver.py); what it publishes and the control requests it
serves, typed (run_status.py) through the control actor (control_actor.py); when the next call is submitted
(follow_on.py); what the run reports: metrics.jsonl, events, Ray metrics (metrics.py), the metrics line and
closing events (reporting.py), progress (progress.py), trackers (tracking.py), profiles (profiles.py)."""
