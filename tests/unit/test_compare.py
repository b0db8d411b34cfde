"""``anytrain compare``: aligned curves from metrics.jsonl, difference / throughput tables, --assert-within, the PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from anytrain.errors import AnytrainError
from anytrain.evals.compare import compare_runs, load_curves, plot_curves
from tests.conftest import cli_in_process as cli


def write_run(
    path: Path,
    losses: list[float],
    tokens_per_step: int = 128,
    bump: dict[int, float] | None = None,
    tokens_per_s: float = 1000.0,
) -> Path:
    """A run dir whose metrics.jsonl logs train loss at every step and val loss every 5 steps."""
    path.mkdir(parents=True)
    records = []
    for step, loss in enumerate(losses, 1):
        loss += (bump or {}).get(step, 0.0)
        records.append(
            {
                "kind": "train",
                "step": step,
                "loss": loss,
                "tokens_seen": step * tokens_per_step,
                "tokens_per_s": tokens_per_s,
                "mfu": 0.25,
                "peak_mem_gib": 1.5,
            }
        )
        if step % 5 == 0:
            records.append({"kind": "eval", "step": step, "val_loss": loss + 0.1})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


LOSSES = [6.0 - 0.1 * i for i in range(20)]


def test_identical_runs_pass_and_a_planted_divergence_fails(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", LOSSES), write_run(tmp_path / "b", LOSSES, tokens_per_s=900.0)
    bad = write_run(tmp_path / "bad", LOSSES, bump={12: 0.5})
    code, out, err = cli(capsys, "compare", str(a), str(b), "--assert-within", "0")
    assert code == 0, err
    assert "b                        loss          20          0          0" in out
    assert "b                            20          900   25.0%      1.50" in out
    code, out, err = cli(capsys, "compare", str(a), str(b), str(bad), "--assert-within", "0.1")
    assert code == 1 and "bad                      loss          20        0.5      0.025" in out  # table first
    assert err.strip() == "error: bad: loss differs from a by up to 0.5 (> --assert-within 0.1) over 20 points"


def test_align_by_tokens_across_batch_sizes(tmp_path):
    # run b takes twice the tokens per step: its step s meets run a's step 2s
    a = write_run(tmp_path / "a", LOSSES)
    b = write_run(tmp_path / "b", [LOSSES[2 * i + 1] for i in range(10)], tokens_per_step=256)
    result = compare_runs([a, b], by="tokens")
    assert result["differences"]["b"]["loss"] == {"points": 10, "max_abs": 0.0, "mean_abs": 0.0}
    assert load_curves(b, "tokens").curves["val_loss"] == {
        1280: pytest.approx(LOSSES[9] + 0.1),
        2560: pytest.approx(LOSSES[19] + 0.1),
    }
    assert result["differences"]["b"]["val_loss"]["points"] == 2  # tokens 1280 and 2560


def test_a_resumed_step_keeps_its_last_value(tmp_path):
    run = write_run(tmp_path / "r", LOSSES[:4])
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "resume", "step": 2}) + "\n")
        f.write(json.dumps({"kind": "train", "step": 3, "loss": 9.0, "tokens_seen": 384}) + "\n")
    assert load_curves(run).curves["loss"][3] == 9.0


def test_png_and_the_missing_extra(tmp_path, monkeypatch):
    a, b = write_run(tmp_path / "a", LOSSES), write_run(tmp_path / "b", LOSSES)
    pytest.importorskip("matplotlib")
    out = compare_runs([a, b], out=tmp_path / "plots" / "curves.png")["plot"]
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(AnytrainError, match=r"^--out needs matplotlib: pip install 'anytrain\[plot\]'$"):
        plot_curves([load_curves(a)], "step", tmp_path / "x.png")


def test_bad_input_is_one_line(tmp_path, capsys):
    a = write_run(tmp_path / "a", LOSSES)
    code, _, err = cli(capsys, "compare", str(a), str(tmp_path / "nothere"))
    assert (
        code == 2
        and err.strip()
        == f"error: {tmp_path / 'nothere'}: no metrics.jsonl; is this a directory written by `anytrain train`?"
    )
    code, _, err = cli(capsys, "compare", str(a), str(a), "--by", "time")
    assert code == 2 and err.strip() == "error: --by: expected step or tokens, got 'time'"


def test_assert_metric_picks_the_losses_the_gate_reads(tmp_path, capsys):
    """--assert-metric loss gates the training loss only, val_loss the validation loss only, both (the default) each;
    a run whose last val_loss is 0.1 off but whose final smoothed loss is 0.02 off passes only the first at 0.05."""
    a = write_run(tmp_path / "a", LOSSES)
    late = write_run(tmp_path / "late", LOSSES, bump={20: 0.1})  # the last step: its val point and 1/5 of the mean
    gate = ["compare", str(a), str(late), "--final", "5", "--assert-within", "0.05"]
    code, _, err = cli(capsys, *gate, "--assert-metric", "loss")
    assert code == 0, err
    code, _, err = cli(capsys, *gate)
    assert code == 1 and err.strip() == "error: late: last val_loss differs from a's by 0.1 (> --assert-within 0.05)"
    code, _, err = cli(capsys, *gate, "--assert-metric", "val_loss")
    assert code == 1
    code, _, err = cli(capsys, "compare", str(a), str(late), "--assert-within", "0.05", "--assert-metric", "loss")
    assert code == 1 and "late: loss differs from a by up to 0.1" in err  # every point of the training curve
    code, _, err = cli(capsys, *gate, "--assert-metric", "ppl")
    assert code == 2 and err.strip() == "error: --assert-metric: expected loss, val_loss or both, got 'ppl'"


def test_final_smoothed_loss_gates_assert_within(tmp_path, capsys):
    """--final N: the mean of the last N losses and the last val_loss are compared; a run noisy step by step but
    ending at the same loss passes, one ending higher fails; --final 0 is one line."""
    a = write_run(tmp_path / "a", LOSSES)
    noisy = write_run(tmp_path / "noisy", LOSSES, bump={16: 0.3, 17: -0.3})  # mean of the last 5 unchanged
    high = write_run(tmp_path / "high", LOSSES, bump={s: 0.05 for s in range(16, 21)})
    code, out, err = cli(capsys, "compare", str(a), str(noisy), "--final", "5", "--assert-within", "0.01")
    assert code == 0, err
    assert "noisy                              4.3000   0.0000         4.2000   0.0000" in out
    code, out, err = cli(capsys, "compare", str(a), str(noisy), "--assert-within", "0.01")  # every point: fails
    assert code == 1
    code, out, err = cli(capsys, "compare", str(a), str(high), "--final", "5", "--assert-within", "0.04")
    assert code == 1
    assert err.strip() == "error: high: final smoothed loss (last 5) differs from a's by 0.05 (> --assert-within 0.04)"
    code, out, err = cli(capsys, "compare", str(a), str(high), "--final", "0")
    assert code != 0 and err.strip().startswith("error: --final:") and len(err.strip().splitlines()) == 1
