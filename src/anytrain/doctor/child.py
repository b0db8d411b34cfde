"""The doctor's one-device tiny training, run as a child process: ``python -m anytrain.doctor.child --world W
--run-dir DIR --out FILE [--checkpoint-interval N] [--pause-at-step N] [--resume]`` trains ``smoke.smoke_config`` on
``smoke.corpus_source`` in DIR and writes {"losses": {step: loss}} (from DIR/metrics.jsonl) to FILE."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from anytrain.doctor.smoke import corpus_source, smoke_config


class PausingSource:
    """Hands out batches until ``step``, then blocks reading stdin (the doctor kills the process there; if the
    doctor is gone, stdin ends and the run goes on)."""

    def __init__(self, source, step: int) -> None:
        self.source, self.step = source, step

    def rank_batch(self, step: int, dp_rank: int, dp_world: int):
        if step == self.step:
            sys.stdin.read()
        return self.source.rank_batch(step, dp_rank, dp_world)


def main(argv: list[str] | None = None) -> None:
    """A one-device tiny training (the doctor's child): writes {"losses": {step: loss}} read from metrics.jsonl."""
    parser = argparse.ArgumentParser(prog="python -m anytrain.doctor.child")
    parser.add_argument("--world", type=int, required=True, help="Ranks of the all-rank run (the global batch).")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--checkpoint-interval", type=int, default=0)
    parser.add_argument("--pause-at-step", type=int, default=-1, help="Wait (read stdin) before this step's batch.")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    from anytrain.parallel.env import discover
    from anytrain.train.trainer import Trainer

    if discover().is_distributed:
        raise SystemExit("error: the doctor's one-device run found launcher variables; it must run as one process")
    cfg = smoke_config(args.world, args.device, checkpoint_interval=args.checkpoint_interval)
    source = corpus_source(cfg.train.global_batch)
    if args.pause_at_step >= 0:
        source = PausingSource(source, args.pause_at_step)
    trainer = Trainer(cfg, batches=source, run_dir=args.run_dir, resume=args.resume)
    try:
        trainer.train()
    finally:
        trainer.close()
    losses = {}
    for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            losses[record["step"]] = record["loss"]  # a resumed run's records come after the killed run's
    Path(args.out).write_text(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
