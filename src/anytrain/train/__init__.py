"""Training: optimizer and LR schedule, DCP checkpoints, metrics, and the Trainer."""
