"""Mamba-2 LM: shapes, parameter / FLOP formulas, every flavour's size on the meta device, HF key names and the
mixer's numerics against transformers' Mamba2Mixer, document masking, causality, init, training, config errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from anytrain import models
from anytrain.config import ModelConfig, RunConfig
from anytrain.config.checks import check_document_mask
from anytrain.errors import ConfigError
from anytrain.models.mamba2 import MAMBA2_FLAVOURS, Mamba2, Mamba2Args
from anytrain.models.mamba2 import hf as mamba2_hf
from tests.conftest import packed_documents

transformers = pytest.importorskip("transformers")


def small_args(**kw) -> Mamba2Args:
    """D 16, E 32, P 8 -> H 4, G 2, N 4, K 3, V 100, L 2, chunk 4."""
    base = dict(vocab_size=100, d_model=16, n_layers=2, d_state=4, d_conv=3, headdim=8, ngroups=2, chunk_size=4)
    return Mamba2Args(**{**base, **kw})


def debug_model(seed: int = 0, **kw) -> Mamba2:
    torch.manual_seed(seed)
    return Mamba2(Mamba2Args(**{**MAMBA2_FLAVOURS["debug"], **kw}))


def test_forward_shape_loss_and_low_precision():
    model = debug_model()
    tokens, targets = torch.randint(0, 512, (3, 17)), torch.randint(0, 512, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, 512) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert len(model.blocks()) == 2
    with torch.no_grad():
        expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        torch.testing.assert_close(model(tokens, targets), expected, atol=1e-5, rtol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(model(tokens, targets), expected, atol=5e-2, rtol=0)
        bf16 = debug_model(residual_in_fp32=False).to(torch.bfloat16)
        assert torch.isfinite(bf16(tokens, targets))


def test_param_count_matches_hand_computation():
    a = small_args()
    assert (a.d_inner, a.nheads, a.conv_dim, a.in_proj_dim) == (32, 4, 48, 84)
    in_proj = 16 * (2 * 32 + 2 * 2 * 4 + 4)  # D·(2E + 2GN + H)
    conv = 48 * 3 + 48  # (E + 2GN)·K weights + bias
    vectors = 3 * 4  # dt_bias, A_log, D
    gated_norm, out_proj, norm = 32, 32 * 16, 16
    per_layer = in_proj + conv + vectors + gated_norm + out_proj + norm
    assert per_layer == 1344 + 192 + 12 + 32 + 512 + 16 == 2108
    tied = Mamba2(a)
    assert tied.num_params() == 100 * 16 + 2 * per_layer + 16 == 5832
    assert tied.num_params(exclude_embedding=True) == 5832  # the input table out, the (shared) head matmul in
    untied = Mamba2(small_args(tie_embeddings=False))
    assert untied.num_params() == 7432 and untied.num_params(exclude_embedding=True) == 5832


def test_flops_per_token_formula():
    model = Mamba2(small_args())
    # 6·N + 6·L·(Q·(G·N + E) + 2·E·N) with Q = min(chunk_size, seq_len)
    assert model.flops_per_token(64) == 6 * 5832 + 6 * 2 * (4 * (2 * 4 + 32) + 2 * 32 * 4) == 39984
    assert model.flops_per_token(2) == 6 * 5832 + 6 * 2 * (2 * (2 * 4 + 32) + 2 * 32 * 4)


# the released checkpoints' names (the Mamba-2 paper's sizes); 1.3b is the published d 2048 x 48 layers, whose
# tensors hold 3.4% more than its name says (state-spaces/mamba2-1.3b: 1,343,757,312, what HF's class counts too)
NOMINAL = {"130m": 130e6, "370m": 370e6, "780m": 780e6, "2.7b": 2.7e9}
EXACT = {"130m": 128_989_632, "370m": 368_346_624, "780m": 780_161_280, "1.3b": 1_343_757_312, "2.7b": 2_702_599_680}


def hf_config(a: Mamba2Args) -> transformers.Mamba2Config:
    return transformers.Mamba2Config(
        vocab_size=a.vocab_size,
        hidden_size=a.d_model,
        num_hidden_layers=a.n_layers,
        state_size=a.d_state,
        head_dim=a.headdim,
        num_heads=a.nheads,
        n_groups=a.ngroups,
        expand=a.expand,
        conv_kernel=a.d_conv,
        chunk_size=a.chunk_size,
        layer_norm_epsilon=a.norm_eps,
        tie_word_embeddings=a.tie_embeddings,
    )


@pytest.mark.parametrize("name", list(MAMBA2_FLAVOURS))
def test_flavours_build_on_meta_with_the_published_counts(name):
    """Every flavour builds on the meta device with exactly the parameter count of transformers' Mamba2ForCausalLM of
    the same config, and the released sizes within 1% of their names (1.3b: its published count)."""
    a = models.resolve_args(ModelConfig(arch="mamba2", flavour=name))
    with torch.device("meta"):
        model = Mamba2(a)
        hf = transformers.Mamba2ForCausalLM(hf_config(a))
    D, E, H, G, N, K, V, L = a.d_model, a.d_inner, a.nheads, a.ngroups, a.d_state, a.d_conv, a.vocab_size, a.n_layers
    per_layer = D * (2 * E + 2 * G * N + H) + (E + 2 * G * N) * (K + 1) + 3 * H + E + E * D + D
    assert model.num_params() == V * D + L * per_layer + D == sum(p.numel() for p in hf.parameters())
    if name in EXACT:
        assert (V, a.d_state, a.headdim, a.expand, a.ngroups, a.chunk_size) == (50288, 128, 64, 2, 1, 256)
        assert model.num_params() == EXACT[name]
    if name in NOMINAL:
        assert abs(model.num_params() / NOMINAL[name] - 1) < 0.01
    if name == "tiny-mamba2":
        assert 5e6 <= model.num_params() <= 10e6


def test_state_dict_keys_and_shapes_match_hf():
    for tie in (True, False):
        a = small_args(n_layers=1, tie_embeddings=tie)
        shapes = {k: v.shape for k, v in Mamba2(a).state_dict().items()}  # HF's in_proj / conv1d stacked from pieces
        theirs = {k: tuple(v.shape) for k, v in transformers.Mamba2ForCausalLM(hf_config(a)).state_dict().items()}
        assert mamba2_hf.hf_shapes(shapes) == theirs and list(mamba2_hf.hf_shapes(shapes)) == list(theirs)
        sd = Mamba2(a).state_dict()
        assert (sd["lm_head.weight"].data_ptr() == sd["backbone.embeddings.weight"].data_ptr()) == tie


@pytest.mark.parametrize("groups", [1, 2])
def test_mixer_matches_transformers(groups):
    """One mixer with HF's weights (norm, D, dt_bias moved off their init) on the same input: equal outputs and
    equal input gradients (fp32; HF's torch path: its conv, its chunked scan at another chunk size, its norm)."""
    a = small_args(ngroups=groups, chunk_size=3)
    torch.manual_seed(groups)
    theirs = transformers.Mamba2ForCausalLM(hf_config(small_args(ngroups=groups))).backbone.layers[0].mixer.eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if name.startswith(("norm", "D", "dt_bias", "conv1d.bias")):
                param.add_(0.3 * torch.randn_like(param))
    ours = Mamba2(a).blocks()[0].mixer
    wanted: dict[str, list[str]] = {}
    for name in ours.state_dict():  # HF's in_proj / conv1d cut into our pieces
        wanted.setdefault(mamba2_hf.hf_name(name), []).append(name)
    pieces = {}
    for key, tensor in theirs.state_dict().items():
        pieces.update(mamba2_hf.from_hf_tensor(tensor, wanted[key], a))
    ours.load_state_dict(pieces)
    assert dict(mamba2_hf.to_hf_tensors(a, ours.state_dict())).keys() == theirs.state_dict().keys()
    h = torch.randn(2, 11, 16, requires_grad=True)
    y_ours, y_theirs = ours(h), theirs(h)
    torch.testing.assert_close(y_ours, y_theirs, rtol=1e-5, atol=1e-6)
    g_ours, g_theirs = (torch.autograd.grad(y.square().sum(), h)[0] for y in (y_ours, y_theirs))
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-5)


def test_causal():
    model = debug_model()
    a = torch.randint(0, 512, (2, 20))
    b = a.clone()
    b[:, 9:] = torch.randint(0, 512, (2, 11))
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :9], lb[:, :9], atol=1e-6, rtol=0)
    assert not torch.allclose(la[:, 9:], lb[:, 9:])


def test_document_mask_gives_each_document_its_own_outputs():
    """With document_eos_id set, every document of a packed row (EOS-terminated, the last cut off) has the logits
    it has alone: the conv window and the SSD state restart after each EOS; without it the later documents differ."""
    eos = 3
    model = debug_model(seed=2)
    docs = packed_documents(eos, (5, 1, 12, 7))
    row = torch.cat(docs)[None]  # (1, 28)
    with torch.no_grad():
        plain = model(row)
        model.document_eos_id = eos
        packed = model(row)
        alone = torch.cat([model(d[None]) for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(plain[:, :6], packed[:, :6], rtol=0, atol=1e-6)  # the first document is unchanged
    assert not torch.allclose(plain[:, 6:], packed[:, 6:], atol=1e-3)


def test_document_mask_is_accepted_for_mamba2_only_among_the_ssms():
    cfg = RunConfig(model=ModelConfig(arch="mamba2", flavour="debug"))
    cfg.data.document_mask = True
    check_document_mask(cfg)
    cfg.model.arch = "mamba"
    with pytest.raises(ConfigError, match=r"^data\.document_mask: Mamba carries its scan state"):
        check_document_mask(cfg)


def _meta_then_init(seed: int, tie: bool = True) -> Mamba2:
    with torch.device("meta"):
        model = Mamba2(Mamba2Args(**MAMBA2_FLAVOURS["debug"], tie_embeddings=tie))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_init_weights_after_to_empty_is_complete_and_deterministic(tie):
    m1, m2, m3 = _meta_then_init(7, tie), _meta_then_init(7, tie), _meta_then_init(8, tie)
    assert (m1.lm_head.weight is m1.backbone.embeddings.weight) == tie
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    for key, value in s1.items():
        assert torch.isfinite(value).all(), key
        assert torch.equal(value, s2[key]), key
    assert not torch.equal(s1["backbone.embeddings.weight"], s3["backbone.embeddings.weight"])
    args, mixer = m1.args, m1.blocks()[0].mixer
    # mamba-ssm's init: -A uniform in [1, 16], D = 1, softplus(dt_bias) in [dt_min, dt_max], out_proj / sqrt(L)
    a = torch.exp(mixer.A_log)
    assert a.min() >= args.a_init_min and a.max() <= args.a_init_max and a.std() > 0
    assert torch.equal(mixer.D, torch.ones(args.nheads))
    dt = F.softplus(mixer.dt_bias)
    assert dt.min() >= args.dt_min * 0.999 and dt.max() <= args.dt_max * 1.001
    assert mixer.out_proj.weight.abs().max() <= 1 / math.sqrt(args.d_inner) / math.sqrt(args.n_layers)
    assert torch.equal(mixer.norm.weight, torch.ones(args.d_inner))
    assert abs(m1.backbone.embeddings.weight.std().item() - args.init_std) < 0.002


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


def test_pipeline_stages_compute_the_whole_model():
    from anytrain.parallel.pipeline import prune_to_stage

    model = debug_model(tie_embeddings=False)
    tokens = torch.randint(0, 512, (2, 16))
    first, last = prune_to_stage(model, 0, 2), prune_to_stage(model, 1, 2)
    assert models.spec_of(first).name == "mamba2" and len(first.blocks()) == len(last.blocks()) == 1
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens), targets=tokens), model(tokens, targets=tokens), rtol=0, atol=0)


def test_generate_appends_tokens():
    out = debug_model().generate(torch.tensor([[1, 2, 3]]), 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and torch.equal(out[:, :3], torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"headdim": 24}, "headdim"),
        ({"ngroups": 3}, "ngroups"),
        ({"d_conv": 5}, "d_conv"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"a_init_min": 20.0}, "a_init_min"),
        ({"dt_min": 0.5}, "dt_min"),
    ],
)
def test_bad_args_raise_config_error_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=rf"^model\.args\.{field}:"):
        models.resolve_args(ModelConfig(arch="mamba2", flavour="debug", args=override))


def test_registry_builds_flavours_and_rejects_unknown_fields():
    assert isinstance(models.build_model(ModelConfig(arch="mamba2", flavour="debug")), Mamba2)
    assert "1.3b" in models.list_flavours()["mamba2"]
    with pytest.raises(ConfigError, match=r"model\.args\.dt_rank: unknown field"):
        models.resolve_args(ModelConfig(arch="mamba2", flavour="debug", args={"dt_rank": 4}))


def test_tensor_parallel_degrees_the_mixer_cannot_split_are_one_line_naming_the_field():
    from anytrain.models.mamba2.parallelize import check_tensor_parallel

    a = small_args()  # 4 heads in 2 groups
    check_tensor_parallel(a, 2)
    check_tensor_parallel(small_args(ngroups=1), 4)  # one group: B and C replicated
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(a, 3)
    assert str(err.value) == (
        "parallel.tp: 3 does not divide the Mamba-2 head count 4 (expand·d_model / model.args.headdim); "
        "choose a divisor"
    )
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(a, 4)
    assert str(err.value) == (
        "parallel.tp: 4 does not divide model.args.ngroups 2 (B and C are split by groups); choose a divisor"
    )
