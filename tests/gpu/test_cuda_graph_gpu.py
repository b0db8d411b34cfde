"""train.cuda_graphs on a real GPU: the replayed micro-steps train exactly like the eager ones (run on a lent machine:
pytest -m gpu tests/gpu)."""

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

RECIPES = Path(__file__).resolve().parents[2] / "configs"


def _config(small_data, arch: str, graphs: bool, dtype: str, compile_blocks: bool = False, extra=()):
    from anytrain.config import load_config

    recipes = {"mamba": "tiny-mamba.yaml", "mamba2": "tiny-mamba2.yaml", "hybrid": "tiny-hybrid.yaml"}
    recipe = recipes.get(arch, "tiny.yaml")
    cfg = load_config(
        RECIPES / recipe,
        [
            "--model.flavour",
            "debug",
            "--data.path",
            str(small_data),
            "--data.seq_len",
            "64",
            "--train.global_batch",
            "8",
            "--train.micro_batch",
            "4",
            "--train.steps",
            "6",
            "--train.lr",
            "1e-2",
            "--train.warmup_steps",
            "0",
            "--train.dtype",
            dtype,
            "--train.eval_batches",
            "2",
            "--train.cuda_graphs",
            str(graphs).lower(),
            "--train.compile",
            str(compile_blocks).lower(),
            "--checkpoint.save_final",
            "false",
            "--checkpoint.interval",
            "0",
            *extra,
        ],
    )
    cfg.device = "gpu"
    return cfg


def _trainer(small_data, run_dir, arch: str, graphs: bool, dtype: str, compile_blocks: bool = False, extra=()):
    from anytrain.train.trainer import Trainer

    return Trainer(_config(small_data, arch, graphs, dtype, compile_blocks, extra), run_dir=str(run_dir))


def _run(trainer, steps: int = 6) -> tuple[list[float], list[torch.Tensor], float]:
    losses = []
    for step in range(steps):
        loss, _, _ = trainer.train_step(step)
        losses.append(loss.item())
        if step == 2:
            val = trainer.evaluator.evaluate()  # an eager no-grad forward between replays must not disturb the graph
    weights = [p.detach().float().cpu().clone() for p in trainer.model.parameters()]
    trainer.close()
    return losses, weights, val


@pytest.mark.parametrize("arch", ["transformer", "mamba", "mamba2", "hybrid"])
def test_graph_replay_trains_like_eager_fp32(small_data, tmp_path, arch):
    """fp32 (and the deterministic scan backward): losses, validation loss and final weights of the graphed run equal
    the eager run's to float rounding; every micro-step after the first replayed the graph."""
    deterministic = ("--kernels.deterministic", "true")  # the scan's dB/dC without atomics: bit-stable reductions
    eager = _run(_trainer(small_data, tmp_path / "eager", arch, False, "fp32", extra=deterministic))
    graphed_trainer = _trainer(small_data, tmp_path / "graphs", arch, True, "fp32", extra=deterministic)
    assert graphed_trainer.graphed is not None
    graphed = _run(graphed_trainer)
    assert graphed_trainer.graphed.replays == 6 * 2  # 6 steps x 2 micro-batches, the first one captured, then replayed
    torch.testing.assert_close(torch.tensor(graphed[0]), torch.tensor(eager[0]), rtol=1e-5, atol=1e-5)
    assert abs(graphed[2] - eager[2]) < 1e-4
    for g, e in zip(graphed[1], eager[1], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert graphed[0][-1] < graphed[0][0]


@pytest.mark.parametrize("arch", ["transformer", "mamba", "mamba2", "hybrid"])
def test_graph_replay_with_bf16_autocast_and_compile(small_data, tmp_path, arch):
    """The recipes' setting: bf16 autocast (weight casts captured), per-block compile inside the capture."""
    eager = _run(_trainer(small_data, tmp_path / "eager", arch, False, "bf16", compile_blocks=True))
    graphed_trainer = _trainer(small_data, tmp_path / "graphs", arch, True, "bf16", compile_blocks=True)
    graphed = _run(graphed_trainer)
    assert graphed_trainer.graphed.replays == 6 * 2
    torch.testing.assert_close(torch.tensor(graphed[0]), torch.tensor(eager[0]), rtol=2e-2, atol=2e-2)
    assert graphed[0][-1] < graphed[0][0]


def test_graphed_nonfinite_step_is_skipped_on_the_device_and_reported(small_data, tmp_path):
    """The lagged check with graphs, one micro-batch per step: an inf weight (the graph reads it in place) makes step
    4's gradients non-finite; its update is skipped on the device (fused AdamW found_inf), step 5 reports step 4 as
    non-finite, and the captured gradient buffers are zeroed in place, not dropped."""
    trainer = _trainer(small_data, tmp_path / "nan", "transformer", True, "bf16", extra=("--train.micro_batch", "8"))
    assert trainer.guard.uses_lag() and trainer.layout.plan.grad_accum == 1
    for step in range(4):
        _, _, status = trainer.train_step(step)
        assert not status.nonfinite
    params = list(trainer.model.parameters())
    victim = params[len(params) // 2]
    with torch.no_grad():
        victim.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in params]
    _, _, status = trainer.train_step(4)  # the verdict is read one step late
    assert not status.nonfinite
    _, _, status = trainer.train_step(5)
    assert status.nonfinite and status.step == 4
    for p, b in zip(params, before, strict=True):  # step 4's update was skipped: nothing moved
        assert torch.equal(p.detach(), b)
    graphed = trainer.graphed
    assert graphed.replays == 6
    assert all(p.grad is g and not g.any() for p, g in zip(graphed.params, graphed.grads, strict=True))
    trainer.close()


def test_graphed_run_resumes_like_an_uninterrupted_one(small_data, tmp_path):
    """Trainer.train() with graphs end to end (logging, evaluation, a checkpoint, summary.json), and a run stopped at
    step 3 and resumed (a new capture on the restored weights) ends with the same weights as one that was not."""
    from anytrain.train.trainer import Trainer

    def run(run_dir, steps, resume=False):
        extra = ("--train.steps", "6", "--train.stop_at_step", str(steps), "--checkpoint.interval", "3")
        trainer = Trainer(
            _config(small_data, "transformer", True, "fp32", extra=extra), run_dir=str(run_dir), resume=resume
        )
        summary = trainer.train()
        weights = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.close()
        return summary, weights

    whole, w_whole = run(tmp_path / "whole", 6)
    assert whole["cuda_graph_replays"] == 6 * 2 and whole["steps"] == 6 and whole["peak_reserved_gib"] > 0
    first, _ = run(tmp_path / "split", 3)
    assert first["steps"] == 3
    second, w_split = run(tmp_path / "split", 6, resume=True)
    assert second["steps"] == 6 and second["cuda_graph_replays"] == 3 * 2
    for a, b in zip(w_split, w_whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert abs(second["final_val_loss"] - whole["final_val_loss"]) < 1e-4


def test_graph_replay_of_an_hf_model(small_data, tmp_path):
    """``model.arch: hf`` (a tiny random transformers Llama, mask-free SDPA), bf16 autocast, the whole body compiled
    (compile_scope auto): the captured micro-step replays without a host sync and trains like the eager one."""
    transformers = pytest.importorskip("transformers")
    from anytrain.train.trainer import Trainer

    folder = tmp_path / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        vocab_size=512,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    hf = ("--model.arch", "hf", "--model.hf_path", str(folder), "--train.compile_scope", "auto")

    def trainer(name: str, graphs: bool):
        return Trainer(
            _config(small_data, "transformer", graphs, "bf16", compile_blocks=True, extra=hf),
            run_dir=str(tmp_path / name),
        )

    eager = _run(trainer("eager", False))
    graphed_trainer = trainer("graphs", True)
    assert graphed_trainer.graphed is not None and graphed_trainer.raw_model.mask_free
    graphed = _run(graphed_trainer)
    assert graphed_trainer.graphed.replays == 6 * 2
    torch.testing.assert_close(torch.tensor(graphed[0]), torch.tensor(eager[0]), rtol=2e-2, atol=2e-2)
    assert graphed[0][-1] < graphed[0][0]
