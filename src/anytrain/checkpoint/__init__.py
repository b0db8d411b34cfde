"""Checkpoint storage: loading DCP checkpoints without running code from them (``safe_load``)."""
