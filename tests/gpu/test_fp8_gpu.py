"""train.fp8 on a real FP8 GPU (torchao's scaled matmuls, no emulation): every recipe trains the debug Transformer
like bf16; FP8 composes with per-block compile, CUDA graphs and activation checkpointing; the fused Mamba mixer
hands its FP8 projections to the module path. Run on a lent machine: pytest -m gpu tests/gpu."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

RECIPES = Path(__file__).resolve().parents[2] / "configs"


def _fp8_capable() -> bool:
    from anytrain import hardware

    return importlib.util.find_spec("torchao") is not None and hardware.fp8_support(torch.device("cuda", 0)) is None


needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or not _fp8_capable(), reason="needs torchao, FP8 GPU")


def _trainer(small_data, run_dir, arch: str = "transformer", *extra: str):
    from anytrain.config import load_config
    from anytrain.train.trainer import Trainer

    recipe = "tiny-mamba.yaml" if arch == "mamba" else "tiny.yaml"
    args = ["--model.flavour", "debug", "--data.path", str(small_data), "--data.seq_len", "64"]
    args += ["--train.global_batch", "8", "--train.micro_batch", "4", "--train.steps", "8", "--train.lr", "1e-2"]
    args += ["--train.warmup_steps", "0", "--train.dtype", "bf16", "--train.eval_batches", "0"]
    args += ["--checkpoint.save_final", "false", "--checkpoint.interval", "0", "--train.fp8_filter", "aligned"]
    cfg = load_config(RECIPES / recipe, [*args, *extra])
    cfg.device = "gpu"
    return Trainer(cfg, run_dir=str(run_dir))


def _losses(trainer, steps: int = 8) -> list[float]:
    losses = [trainer.train_step(step)[0].item() for step in range(steps)]
    trainer.close()
    return losses


def _float8_layers(trainer) -> int:
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in trainer.model.modules())


@needs_fp8
def test_this_gpu_runs_both_scalings():
    from anytrain import hardware

    device = torch.device("cuda", 0)
    assert hardware.fp8_support(device, rowwise=False) is None
    assert hardware.fp8_support(device, rowwise=True) is None
    assert hardware.fp8_dtypes(device)[0] in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_recipes_train_like_bf16(small_data, tmp_path, recipe):
    bf16 = _losses(_trainer(small_data, tmp_path / "bf16"))
    trainer = _trainer(small_data, tmp_path / recipe, "transformer", "--train.fp8", recipe)
    assert _float8_layers(trainer) == 14  # 2 blocks x (wq, wk, wv, wo, w1, w2, w3); not the head
    fp8 = _losses(trainer)
    assert fp8[-1] < fp8[0]
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(bf16), rtol=3e-2, atol=3e-2)


@needs_fp8
@pytest.mark.parametrize("arch", ["transformer", "mamba"])
def test_fp8_with_compile_and_cuda_graphs(small_data, tmp_path, arch):
    """tensorwise FP8 layers inside per-block compiled graphs, the micro-step captured and replayed: the same losses
    as the eager FP8 run (Mamba: the fused mixer is bypassed for the FP8 projections' module path)."""
    eager = _losses(_trainer(small_data, tmp_path / "eager", arch, "--train.fp8", "tensorwise"))
    graphed_trainer = _trainer(
        small_data,
        tmp_path / "graphs",
        arch,
        "--train.fp8",
        "tensorwise",
        "--train.compile",
        "true",
        "--train.cuda_graphs",
        "true",
    )
    assert graphed_trainer.graphed is not None
    graphed = _losses(graphed_trainer)
    assert graphed_trainer.graphed.replays == 8 * 2
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=3e-2, atol=3e-2)
    assert graphed[-1] < graphed[0]


@needs_fp8
def test_fp8_mamba_and_activation_checkpointing_train_like_bf16(small_data, tmp_path):
    bf16 = _losses(_trainer(small_data, tmp_path / "bf16", "mamba"))
    trainer = _trainer(
        small_data, tmp_path / "fp8", "mamba", "--train.fp8", "rowwise", "--train.activation_checkpointing", "full"
    )
    assert _float8_layers(trainer) == 4  # in_proj and out_proj of 2 mixers
    fp8 = _losses(trainer)
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(bf16), rtol=3e-2, atol=3e-2)


@needs_fp8
def test_fp8_hf_model_trains_like_bf16(small_data, tmp_path):
    """model.arch hf: every Linear of the decoder layers in FP8 under bf16 autocast, the LM head not."""
    transformers = pytest.importorskip("transformers")
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.LlamaConfig(vocab_size=512, num_key_value_heads=2, max_position_embeddings=128, **shape)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    hf = ("--model.arch", "hf", "--model.hf_path", str(tmp_path / "llama"), "--model.args.init", "random")
    bf16 = _losses(_trainer(small_data, tmp_path / "bf16", "transformer", *hf))
    trainer = _trainer(small_data, tmp_path / "fp8", "transformer", *hf, "--train.fp8", "rowwise_with_gw_hp")
    assert _float8_layers(trainer) == 14  # q, k, v, o, gate, up, down of 2 layers
    fp8 = _losses(trainer)
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(bf16), rtol=3e-2, atol=3e-2)
