"""Mamba-1 LM: shapes, parameter / FLOP formulas, HF key names, causality, init, training, config errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from anytrain import models
from anytrain.config import ModelConfig
from anytrain.errors import ConfigError
from anytrain.models.mamba import MAMBA_FLAVOURS, Mamba, MambaArgs
from tests.conftest import autocast_block_outputs


def small_args(**kw) -> MambaArgs:
    base = dict(vocab_size=100, d_model=16, n_layers=2, d_state=4, d_conv=3, expand=2)
    return MambaArgs(**{**base, **kw})


def debug_model(seed: int = 0, **kw) -> Mamba:
    torch.manual_seed(seed)
    return Mamba(MambaArgs(**{**MAMBA_FLAVOURS["debug"], **kw}))


def test_forward_shape_and_dtype():
    model = debug_model()
    logits = model(torch.randint(0, 512, (3, 17)))
    assert logits.shape == (3, 17, 512) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert len(model.blocks()) == 2


def test_targets_give_the_mean_next_token_loss():
    model = debug_model()
    tokens, targets = torch.randint(0, 512, (2, 12)), torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        expected = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        torch.testing.assert_close(model(tokens, targets), expected, atol=1e-5, rtol=1e-5)


def test_low_precision_paths_run():
    """bf16 autocast over fp32 weights (single/DDP) and bf16 weights (what FSDP mixed precision hands the blocks)."""
    model = debug_model()
    tokens = torch.randint(0, 512, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(model(tokens).float()).all()
        assert torch.isfinite(model(tokens, tokens))
    bf16 = model.to(torch.bfloat16)
    assert torch.isfinite(bf16(tokens).float()).all() and torch.isfinite(bf16(tokens, tokens))


def test_residual_stream_dtype_under_autocast():
    """residual_in_fp32 (default, HF's) keeps the blocks' residual stream fp32 under autocast; False makes it the
    autocast dtype from the embedding on. Same loss up to bf16 rounding; without autocast both are fp32."""
    fp32_model = debug_model()
    bf16_model = debug_model(residual_in_fp32=False)
    bf16_model.load_state_dict(fp32_model.state_dict())
    tokens = torch.randint(0, 512, (2, 16))
    block_out, losses, plain = autocast_block_outputs(
        {"fp32": fp32_model, "bf16": bf16_model}, lambda m: m.backbone.layers["1"], tokens
    )
    assert plain == {"fp32": torch.float32, "bf16": torch.float32}  # no autocast: fp32 throughout
    assert (block_out["fp32"].dtype, block_out["bf16"].dtype) == (torch.float32, torch.bfloat16)
    torch.testing.assert_close(losses["bf16"], losses["fp32"], rtol=0, atol=2e-2)


def test_pipeline_stages_keep_the_bf16_residual_stream():
    """A pipeline split (MambaStage) runs the same numerics as the whole model under autocast, with the residual
    stream in bf16 on every stage even when the previous stage's output arrives as fp32."""
    from anytrain.parallel.pipeline import prune_to_stage

    model = debug_model(residual_in_fp32=False, tie_embeddings=False)
    tokens = torch.randint(0, 512, (2, 16))
    first, last = prune_to_stage(model, 0, 2), prune_to_stage(model, 1, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(tokens, targets=tokens)
        hidden = first(tokens)
        loss = last(hidden.float(), targets=tokens)
    assert hidden.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_param_count_matches_hand_computation():
    a = small_args()  # D 16, E 32, S 4, K 3, R = ceil(16/16) = 1, V 100, L 2
    assert (a.d_inner, a.dt_rank) == (32, 1)
    in_proj, out_proj = 16 * 64, 32 * 16  # D·2E, E·D
    conv = 32 * 3 + 32  # E·K weights + E bias
    x_proj = 32 * (1 + 2 * 4)  # E·(R + 2S)
    dt_proj = 1 * 32 + 32  # R·E + E bias
    a_log, d_skip, norm = 32 * 4, 32, 16  # E·S, E, D
    per_layer = in_proj + out_proj + conv + x_proj + dt_proj + a_log + d_skip + norm
    assert per_layer == 3 * 16 * 32 + 32 * (3 + 2 * 1 + 3 * 4 + 3) + 16 == 2192  # 3·D·E + E·(K + 2R + 3S + 3) + D
    expected = 100 * 16 + 2 * per_layer + 16  # embedding (= tied head) + layers + norm_f
    tied = Mamba(a)
    assert tied.num_params() == expected == 6000
    assert tied.num_params(exclude_embedding=True) == 6000  # the input table out, the (shared) head matmul in
    untied = Mamba(small_args(tie_embeddings=False))
    assert untied.num_params() == 7600 and untied.num_params(exclude_embedding=True) == 6000


def test_flops_per_token_formula():
    a = small_args()
    model = Mamba(a)
    # 6·N + 3·L·E·(8·S + 10), no seq_len term (linear-time model).
    assert model.flops_per_token(64) == model.flops_per_token(4096) == 6 * 6000 + 3 * 2 * 32 * (8 * 4 + 10) == 44064


@pytest.mark.parametrize("name", list(MAMBA_FLAVOURS))
def test_flavours_build_on_meta_with_formula_counts(name):
    a = MambaArgs(**MAMBA_FLAVOURS[name])
    a.validate()
    with torch.device("meta"):
        model = Mamba(a)
    D, E, S, K, R, V, L = a.d_model, a.d_inner, a.d_state, a.d_conv, a.dt_rank, a.vocab_size, a.n_layers
    assert R == math.ceil(D / 16)
    per_layer = 3 * D * E + E * (K + 2 * R + 3 * S + 3) + D
    assert model.num_params() == V * D + L * per_layer + D
    if name == "130m":
        assert model.num_params() == 129_135_360  # state-spaces/mamba-130m
    if name == "tiny-mamba":
        assert 5e6 <= model.num_params() <= 10e6


HF_KEYS_ONE_LAYER = [  # MambaForCausalLM(MambaConfig(num_hidden_layers=1, ...)).state_dict() keys, in order
    ("backbone.embeddings.weight", (100, 16)),
    ("backbone.layers.0.norm.weight", (16,)),
    ("backbone.layers.0.mixer.A_log", (32, 4)),
    ("backbone.layers.0.mixer.D", (32,)),
    ("backbone.layers.0.mixer.conv1d.weight", (32, 1, 3)),
    ("backbone.layers.0.mixer.conv1d.bias", (32,)),
    ("backbone.layers.0.mixer.in_proj.weight", (64, 16)),
    ("backbone.layers.0.mixer.x_proj.weight", (9, 32)),
    ("backbone.layers.0.mixer.dt_proj.weight", (32, 1)),
    ("backbone.layers.0.mixer.dt_proj.bias", (32,)),
    ("backbone.layers.0.mixer.out_proj.weight", (16, 32)),
    ("backbone.norm_f.weight", (16,)),
    ("lm_head.weight", (100, 16)),
]


@pytest.mark.parametrize("tie", [True, False])
def test_state_dict_keys_match_hf(tie):
    model = Mamba(small_args(n_layers=1, tie_embeddings=tie))
    sd = model.state_dict()
    assert [(k, tuple(v.shape)) for k, v in sd.items()] == HF_KEYS_ONE_LAYER
    assert (sd["lm_head.weight"].data_ptr() == sd["backbone.embeddings.weight"].data_ptr()) == tie


def test_mixer_matches_hf_slow_forward():
    """The kernel wiring (layouts, Δ bias + softplus inside the scan) against HF MambaMixer.slow_forward's maths."""
    model = debug_model(seed=1)
    mixer = model.blocks()[0].mixer
    with torch.no_grad():  # non-trivial D and dt bias
        mixer.D.uniform_(0.5, 1.5)
    h = torch.randn(2, 10, 64)
    E, S, R = mixer.args.d_inner, mixer.args.d_state, mixer.args.dt_rank
    with torch.no_grad():
        xz = mixer.in_proj(h).transpose(1, 2)  # (B, 2E, T)
        x, z = xz.chunk(2, dim=1)
        x = F.silu(mixer.conv1d(x)[..., :10])  # nn.Conv1d with padding K-1, keep the first T outputs
        dt, b, c = mixer.x_proj(x.transpose(1, 2)).split([R, S, S], dim=-1)
        dt = F.softplus(mixer.dt_proj(dt)).transpose(1, 2)  # (B, E, T)
        A = -torch.exp(mixer.A_log.float())
        dA = torch.exp(A[None, :, None, :] * dt[..., None])  # (B, E, T, S)
        dBu = dt[..., None] * b[:, None, :, :] * x[..., None]  # (B, E, T, S)
        state, ys = torch.zeros(2, E, S), []
        for t in range(10):
            state = dA[:, :, t] * state + dBu[:, :, t]
            ys.append(state @ c[:, t, :, None])  # (B, E, 1)
        y = torch.cat(ys, dim=-1) + x * mixer.D[None, :, None]
        expected = mixer.out_proj((y * F.silu(z)).transpose(1, 2))
        torch.testing.assert_close(mixer(h), expected, atol=1e-5, rtol=1e-4)


def test_causal():
    model = debug_model()
    a = torch.randint(0, 512, (2, 16))
    b = a.clone()
    b[:, 9:] = torch.randint(0, 512, (2, 7))
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :9], lb[:, :9], atol=1e-6, rtol=0)
    assert not torch.allclose(la[:, 9:], lb[:, 9:])


def _meta_then_init(seed: int, tie: bool = True) -> Mamba:
    with torch.device("meta"):
        model = Mamba(MambaArgs(**MAMBA_FLAVOURS["debug"], tie_embeddings=tie))
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_init_weights_after_to_empty_is_complete_and_deterministic(tie):
    m1, m2, m3 = _meta_then_init(7, tie), _meta_then_init(7, tie), _meta_then_init(8, tie)
    assert (m1.lm_head.weight is m1.backbone.embeddings.weight) == tie  # to_empty unties; init_weights re-ties
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    for key, value in s1.items():
        assert torch.isfinite(value).all(), key
        assert torch.equal(value, s2[key]), key
    assert not torch.equal(s1["backbone.embeddings.weight"], s3["backbone.embeddings.weight"])
    args, mixer = m1.args, m1.blocks()[0].mixer
    # mamba-ssm's init: A = -(1..S) per channel, D = 1, softplus(dt bias) in [dt_min, dt_max], out_proj / sqrt(L)
    torch.testing.assert_close(-torch.exp(mixer.A_log), -torch.arange(1.0, 9.0).expand(args.d_inner, 8))
    assert torch.equal(mixer.D, torch.ones(args.d_inner))
    dt = F.softplus(mixer.dt_proj.bias)
    assert dt.min() >= args.dt_min * 0.999 and dt.max() <= args.dt_max * 1.001
    assert mixer.dt_proj.weight.abs().max() <= args.dt_rank**-0.5
    bound = 1 / math.sqrt(args.d_inner) / math.sqrt(args.n_layers)  # kaiming-uniform bound, rescaled
    assert mixer.out_proj.weight.abs().max() <= bound
    assert abs(m1.backbone.embeddings.weight.std().item() - args.init_std) < 0.002
    with torch.no_grad():
        assert torch.isfinite(m1(torch.randint(0, 512, (1, 8)))).all()


def test_a_few_steps_on_a_fixed_batch_reduce_the_loss():
    model = debug_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_generate_appends_tokens():
    model = debug_model()
    out = model.generate(torch.tensor([[1, 2, 3]]), 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and torch.equal(out[:, :3], torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"d_state": 0}, "d_state"),
        ({"d_conv": 5}, "d_conv"),
        ({"n_layers": -1}, "n_layers"),
        ({"dt_min": 0.5}, "dt_min"),
        ({"expand": 0}, "expand"),
    ],
)
def test_bad_args_raise_config_error_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=rf"^model\.args\.{field}:"):
        models.resolve_args(ModelConfig(arch="mamba", flavour="debug", args=override))


def test_registry_builds_flavours_and_rejects_unknown_fields():
    args = models.resolve_args(ModelConfig(arch="mamba", flavour="debug", args={"d_state": 4}))
    assert isinstance(args, MambaArgs) and args.d_state == 4 and args.dt_rank == 4
    assert isinstance(models.build_model(ModelConfig(arch="mamba", flavour="debug")), Mamba)
    with pytest.raises(ConfigError, match=r"model\.args\.dim: unknown field"):
        models.resolve_args(ModelConfig(arch="mamba", flavour="debug", args={"dim": 64}))
