import math

import pytest
import torch

from anytrain.config import TrainConfig
from anytrain.train.optim import build_optimizer, lr_factor, param_groups


def test_cosine_schedule():
    cfg = TrainConfig(steps=110, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(109, cfg) == pytest.approx(0.1)
    mid = lr_factor(10 + 99 // 2, cfg)
    assert 0.5 < mid < 0.6
    values = [lr_factor(s, cfg) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_wsd_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    assert lr_factor(50, cfg) == 1.0 and lr_factor(79, cfg) == 1.0
    assert lr_factor(80, cfg) == pytest.approx(1 - 1 / 20)
    assert lr_factor(99, cfg) == pytest.approx(0.0)


def test_constant_schedule():
    cfg = TrainConfig(steps=50, warmup_steps=0, schedule="constant")
    assert {lr_factor(s, cfg) for s in range(50)} == {1.0}


def test_weight_decay_groups():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [(4, 4)]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
    opt = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW) and not math.isnan(opt.param_groups[0]["lr"])


def test_mamba_state_params_are_not_decayed():
    from anytrain.config import ModelConfig
    from anytrain.models import build_model

    model = build_model(ModelConfig(arch="mamba", flavour="debug"))
    decay, no_decay = param_groups(model, 0.1)
    exempt = {id(p) for p in no_decay["params"]}
    for name, param in model.named_parameters():
        if name.endswith(("A_log", ".D")):
            assert id(param) in exempt, name
    assert any(p.ndim == 2 for p in decay["params"])


def test_split_by_mesh_keeps_plain_tensors_together_and_the_group_options():
    from anytrain.train.optim import split_by_mesh

    params = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(3)]
    (part,) = split_by_mesh({"params": params, "weight_decay": 0.1})
    assert part["params"] == params and part["weight_decay"] == 0.1


def test_a_saved_schedule_fits_an_optimizer_with_another_group_count():
    """A tensor-parallel run's checkpoint (a group per mesh) resumes without TP, and the other way round."""
    from anytrain.checkpoint.dcp import _fit_groups

    saved = {"base_lrs": [3e-4] * 3, "_last_lr": [1.5e-4] * 3, "last_epoch": 7, "lr_lambdas": [None] * 3}
    fitted = _fit_groups(saved, 2)
    assert fitted["base_lrs"] == [3e-4, 3e-4] and fitted["_last_lr"] == [1.5e-4, 1.5e-4]
    assert fitted["last_epoch"] == 7 and saved["base_lrs"] == [3e-4] * 3  # the saved state is not modified
    assert _fit_groups(saved, 3)["base_lrs"] == saved["base_lrs"]
