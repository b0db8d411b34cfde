"""Every registered family satisfies models.protocol and reaches parallel/ only through its ModelSpec."""

import ast
from pathlib import Path

import pytest
import torch

from anytrain.config import ModelConfig, load_config
from anytrain.errors import ConfigError
from anytrain.models import REGISTRY, LanguageModel, build_model, spec_of
from anytrain.parallel import parallelize
from anytrain.parallel.mesh import ParallelDims
from anytrain.parallel.pipeline import prune_to_stage

MODELS = Path(__file__).resolve().parents[2] / "src" / "anytrain" / "models"


@pytest.mark.parametrize("arch", sorted(a for a in REGISTRY if a != "hf"))  # hf: tests/integration/test_hf_arch.py
def test_debug_models_satisfy_the_protocol(arch):
    model = build_model(ModelConfig(arch=arch, flavour="debug", args={"tie_embeddings": False}))
    assert isinstance(model, LanguageModel)
    assert spec_of(model) is REGISTRY[arch]
    assert model.hidden_size > 0 and not model.tie_embeddings and len(model.blocks()) == model.args.n_layers
    stage = prune_to_stage(model, 1, 2)  # the last of two stages: the second half of the blocks, the head
    assert spec_of(stage) is REGISTRY[arch] and len(stage.blocks()) == model.args.n_layers // 2
    hidden = torch.randn(2, 8, model.hidden_size)
    assert stage(hidden).shape == (2, 8, model.args.vocab_size)


def test_tied_embeddings_refuse_a_pipeline_split():
    model = build_model(ModelConfig(arch="mamba", flavour="debug"))
    assert model.tie_embeddings
    with pytest.raises(ConfigError, match="parallel.pp: tied embeddings"):
        prune_to_stage(model, 0, 2)


def test_a_family_without_a_tensor_parallel_plan_refuses_tp():
    cfg = load_config(None, ["--model.arch", "mamba", "--model.flavour", "debug", "--parallel.tp", "2"])
    with pytest.raises(ConfigError, match="parallel.tp: tensor parallelism is not implemented for mamba"):
        parallelize(
            build_model(cfg.model), cfg, ParallelDims.from_config(cfg.parallel, 2), torch.device("cpu"), torch.float32
        )


@pytest.mark.parametrize("path", sorted(MODELS.rglob("*.py")), ids=lambda p: str(p.relative_to(MODELS)))
def test_models_do_not_import_torch_distributed(path):
    """Only a family's parallelize.py may (its DTensor plans); the models themselves are single-device."""
    if path.name == "parallelize.py":
        return
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not any(n.startswith("torch.distributed") for n in names), f"{path.name} imports {names}"


def test_a_family_without_the_sequence_sharded_loss_refuses_it_in_one_line():
    cfg = load_config(
        None,
        [
            "--model.arch",
            "mamba2",
            "--model.flavour",
            "debug",
            "--parallel.tp",
            "2",
            "--parallel.tp_sequence_loss",
            "true",
        ],
    )
    with pytest.raises(ConfigError, match="parallel.tp_sequence_loss: not implemented for mamba2"):
        parallelize(
            build_model(cfg.model), cfg, ParallelDims.from_config(cfg.parallel, 2), torch.device("cpu"), torch.float32
        )
