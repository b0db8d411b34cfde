"""bench/mamba2_train.py without a GPU: its rows are the recipes they name, and the mamba-ssm row's config is the
recipe's Mamba-2 model (the smoke run of the anytrain rows is in tests/integration/test_benches.py)."""

from __future__ import annotations

import importlib.util
import types

import pytest

from anytrain.config import load_config
from anytrain.models import resolve_args
from bench import mamba2_train
from tests.conftest import ROOT


@pytest.mark.parametrize("row", mamba2_train.ROWS, ids=lambda r: r.name)
def test_rows_run_their_recipe_with_only_the_global_batch_changed(row):
    recipe = load_config(ROOT / "configs" / row.recipe)
    cfg = mamba2_train.row_config(row, smoke=False)
    want = mamba2_train.settings(recipe)
    want["global_batch"] = mamba2_train.GLOBAL_BATCH
    for key, value in zip(row.overrides[::2], row.overrides[1::2], strict=True):  # the row's declared changes
        want[key.removeprefix("--train.")] = value
    assert mamba2_train.settings(cfg) == want
    assert (cfg.data.seq_len, cfg.train.global_batch) == (2048, 32)  # the same tokens per step in every row


def test_the_recipe_rows_keep_compile_and_checkpointing_as_configured():
    by = {r.name: mamba2_train.settings(mamba2_train.row_config(r, smoke=False)) for r in mamba2_train.ROWS}
    assert by["mamba2-1.3b"]["compile"] and by["mamba2-1.3b"]["activation_checkpointing"] == "full"
    assert by["mamba2-1.3b-noac"]["activation_checkpointing"] == "none"
    assert by["mamba-1.4b"]["compile_scope"] == by["1.1b"]["compile_scope"] == "auto"
    assert by["hybrid-1.2b"]["arch"] == "hybrid" and by["mamba-ssm-1.3b"]["flavour"] == "1.3b"


def _fake_mamba_ssm(monkeypatch, conv_fn=None, conv_fwd=None):
    mixer = types.ModuleType("mamba_ssm.modules.mamba2")
    mixer.causal_conv1d_fn = conv_fn
    ssd = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    ssd.causal_conv1d_fwd_function = conv_fwd
    monkeypatch.setitem(mamba2_train.sys.modules, mixer.__name__, mixer)
    monkeypatch.setitem(mamba2_train.sys.modules, ssd.__name__, ssd)


def test_the_mamba_ssm_config_is_the_recipes_mamba2_and_says_which_path_runs(monkeypatch):
    args = resolve_args(mamba2_train.row_config(mamba2_train.BY_NAME["mamba-ssm-1.3b"], smoke=False).model)
    _fake_mamba_ssm(monkeypatch)  # installed without causal-conv1d
    config, info = mamba2_train.peer_config(args, dict)
    assert config["ssm_cfg"] == {
        "layer": "Mamba2",
        "d_state": 128,
        "d_conv": 4,
        "expand": 2,
        "headdim": 64,
        "ngroups": 1,
        "chunk_size": 256,
        "use_mem_eff_path": False,  # its fused split-conv path needs causal-conv1d's CUDA functions
    }
    assert (config["d_model"], config["n_layer"], config["vocab_size"]) == (2048, 48, 50288)
    assert config["tie_embeddings"] and config["rms_norm"] and config["fused_add_norm"]
    assert config["residual_in_fp32"] and config["d_intermediate"] == 0
    assert "nn.Conv1d" in info["peer_path"] and "use_mem_eff_path=False" in info["peer_path"]

    _fake_mamba_ssm(monkeypatch, conv_fn=object(), conv_fwd=object())  # with causal-conv1d: mamba-ssm's default path
    config, info = mamba2_train.peer_config(args, dict)
    assert config["ssm_cfg"]["use_mem_eff_path"] and "mamba_split_conv1d_scan_combined" in info["peer_path"]


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("mamba_ssm", "einops")), reason="mamba-ssm is not installed"
)
def test_mamba_ssm_builds_the_same_parameters_as_ours():
    # mamba-ssm installed without its CUDA build: MambaLMHeadModel imports through the bare package and the
    # selective_scan_cuda placeholder, and its model of our debug config has exactly our parameter count
    import torch

    from anytrain.models import build_model
    from bench.mamba_ssm_loader import load_lm_head_model

    model_cls, why = load_lm_head_model()
    assert model_cls is not None, why
    from mamba_ssm.models.config_mamba import MambaConfig

    cfg = mamba2_train.row_config(mamba2_train.BY_NAME["mamba-ssm-1.3b"], smoke=True)
    config, info = mamba2_train.peer_config(resolve_args(cfg.model), MambaConfig)
    peer = model_cls(config)
    with torch.device("meta"):
        ours = build_model(cfg.model)
    assert sum(p.numel() for p in {id(p): p for p in peer.parameters()}.values()) == ours.num_params()
    assert peer.lm_head.weight is peer.backbone.embedding.weight
