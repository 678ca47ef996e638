"""The state mover: where every tensor of the training state lives (table), what a rank's part of one is
(regions), and the moves that turn one layout's state into another's (planner)."""
