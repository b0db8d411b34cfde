"""``read_metrics``: metrics.jsonl as the run's history stands after resumes (the resume markers decide)."""

from __future__ import annotations

import json

from anytrain.train.rundir import read_metrics


def test_a_resume_marker_drops_the_records_past_its_step_and_a_repeat_keeps_the_later(tmp_path):
    lines = [
        {"kind": "eval", "step": 0, "val_loss": 9.0},
        *({"kind": "train", "step": s, "loss": 10 - s} for s in range(1, 9)),
        {"kind": "eval", "step": 8, "val_loss": 2.0},
    ]
    lines += [{"kind": "resume", "step": 5, "checkpoint": "c5"}, {"kind": "train", "step": 6, "loss": 0.5}]
    lines += [{"kind": "resume", "step": 0, "checkpoint": None}, {"kind": "eval", "step": 0, "val_loss": 8.0}]
    lines += [{"kind": "train", "step": 1, "loss": 0.1}]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "train", "st'  # a line cut short by a crash
    (tmp_path / "metrics.jsonl").write_text(text)
    kept = [(r["kind"], r["step"], r.get("loss", r.get("val_loss"))) for r in read_metrics(tmp_path)]
    assert kept == [("resume", 0, None), ("eval", 0, 8.0), ("train", 1, 0.1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:12]))
    kept = [(r["kind"], r["step"], r.get("loss")) for r in read_metrics(tmp_path)]
    assert kept == [
        ("eval", 0, None),
        *(("train", s, 10 - s) for s in range(1, 6)),
        ("resume", 5, None),
        ("train", 6, 0.5),
    ]
