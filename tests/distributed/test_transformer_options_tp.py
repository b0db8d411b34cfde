"""Tensor parallelism with the Transformer's options on real gloo processes: an MPT-shaped model (ALiBi, scale-only
LayerNorm, GELU MLP, tied embeddings) and one with every other option (learned positions, LayerNorm bias, linear
biases, QK-norm, untied, GQA) give the single process's first losses at tp 2."""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.test_data_parallel import STEPS, losses, train, write_config

MODELS = {
    "mpt": ("--model.flavour", "mpt-debug"),
    "gpt": (
        "--model.flavour",
        "mpt-debug",
        "--model.args.pos_encoding",
        "learned",
        "--model.args.norm_bias",
        "true",
        "--model.args.bias",
        "true",
        "--model.args.qk_norm",
        "true",
        "--model.args.tie_embeddings",
        "false",
        "--model.args.n_kv_heads",
        "2",
    ),
}


@pytest.fixture(scope="module")
def config(tmp_path_factory, small_data):
    return write_config(tmp_path_factory.mktemp("options_tp"), small_data)


@pytest.mark.parametrize("name", ["mpt", pytest.param("gpt", marks=pytest.mark.slow)])
def test_tp2_first_losses_match_single_process(config, tmp_path, name):
    extra = ("--train.eval_batches", "0", *MODELS[name])
    single = losses(train(config, tmp_path / "single", 1, *extra))
    tp2 = losses(train(config, tmp_path / "tp2", 2, *extra, "--parallel.tp", "2"))
    assert len(tp2) == STEPS
    np.testing.assert_allclose(tp2, single, rtol=0, atol=1e-4)


def test_tp2_sequence_loss_with_a_tied_head_matches_single_process_in_training_and_eval(config, tmp_path):
    """``parallel.tp_sequence_loss`` with the MPT shape's tied embedding (the head's weight is the embedding table:
    the lookup's gradient and the TP-summed head gradient add) and with evaluation (the loss without a backward)."""
    extra = MODELS["mpt"]
    single = train(config, tmp_path / "single", 1, *extra)
    tp2 = train(config, tmp_path / "tp2", 2, *extra, "--parallel.tp", "2", "--parallel.tp_sequence_loss", "true")
    np.testing.assert_allclose(losses(tp2), losses(single), rtol=0, atol=1e-4)
    grads = [[r["grad_norm"] for r in records if r["kind"] == "train"] for records in (single, tp2)]
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-3)  # the head's TP-summed gradient in the clipped norm
    evals = [[r["val_loss"] for r in records if r["kind"] == "eval"] for records in (single, tp2)]
    assert evals[0] and len(evals[1]) == len(evals[0])
    np.testing.assert_allclose(evals[1], evals[0], rtol=0, atol=1e-4)
