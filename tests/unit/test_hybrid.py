"""Hybrid Mamba-2 + attention LM: the layer pattern, reuse of the Mamba-2 and Transformer modules, parameter / FLOP
formulas, every flavour's size on the meta device (and transformers' BambaForCausalLM of the same config), the Bamba
tensor mapping with equal logits, causality, init, training, pipeline stages and config errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anytrain import models
from anytrain.config import ModelConfig
from anytrain.errors import ConfigError
from anytrain.models import conversion
from anytrain.models.conversion import hf_family
from anytrain.models.hybrid import HYBRID_FLAVOURS, Hybrid, HybridArgs, bamba_pattern
from anytrain.models.hybrid import hf as hybrid_hf
from anytrain.models.llama.model import Attention, FeedForward
from anytrain.models.mamba2.model import Mamba2Mixer, ssd_layer_flops
from tests.conftest import packed_documents, split_documents

transformers = pytest.importorskip("transformers")


def small_args(**kw) -> HybridArgs:
    """D 32; Mamba-2 E 64 in 8 heads of 8, 2 groups, state 8, conv 3; attention 4 heads of 8 on 2 KV heads, RoPE on
    half of each head; MLP 48; V 100; pattern M-A-M- (three Bamba layers)."""
    base = dict(
        vocab_size=100,
        d_model=32,
        layers_pattern="M-A-M-",
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_headdim=8,
        mamba_ngroups=2,
        mamba_chunk_size=8,
        attn_heads=4,
        attn_kv_heads=2,
        rope_fraction=0.5,
        ffn_dim=48,
        max_seq_len=64,
    )
    args = HybridArgs(**{**base, **kw})
    args.validate()
    return args


def debug_model(seed: int = 0, **kw) -> Hybrid:
    torch.manual_seed(seed)
    return Hybrid(HybridArgs(**{**HYBRID_FLAVOURS["debug"], **kw}))


def bamba_config(a: HybridArgs) -> transformers.BambaConfig:
    """The BambaConfig of a hybrid made of Bamba layers (what ``hybrid.hf.hf_config`` writes, built directly)."""
    kinds = a.layers_pattern[::2]
    rope = {"rope_type": "default", "rope_theta": a.rope_theta, "partial_rotary_factor": a.rope_fraction}
    return transformers.BambaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.d_model,
        intermediate_size=a.ffn_dim,
        num_hidden_layers=len(kinds),
        attn_layer_indices=[i for i, k in enumerate(kinds) if k == "A"],
        num_attention_heads=a.attn_heads,
        num_key_value_heads=a.attn_kv_heads,
        mamba_n_heads=a.mamba_expand * a.d_model // a.mamba_headdim,
        mamba_d_head=a.mamba_headdim,
        mamba_n_groups=a.mamba_ngroups,
        mamba_d_state=a.mamba_d_state,
        mamba_d_conv=a.mamba_d_conv,
        mamba_expand=a.mamba_expand,
        mamba_chunk_size=a.mamba_chunk_size,
        max_position_embeddings=a.max_seq_len,
        rms_norm_eps=a.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=a.tie_embeddings,
    )


def test_pattern_builds_the_families_modules_in_order():
    model = Hybrid(small_args(layers_pattern="M*-A-M"))
    kinds = [block.kind for block in model.blocks()]
    assert kinds == ["M", "A", "-", "A", "-", "M"] and model.args.n_layers == 6
    blocks = model.blocks()
    assert isinstance(blocks[0].mixer, Mamba2Mixer) and isinstance(blocks[1].attention, Attention)
    assert isinstance(blocks[2].feed_forward, FeedForward) and blocks[2].feed_forward.w3 is not None
    assert [k for k in model.state_dict() if k.startswith("backbone.layers.1.")] == [
        "backbone.layers.1.norm.weight",
        *(f"backbone.layers.1.attention.w{p}.weight" for p in "qkvo"),
    ]
    assert bamba_pattern(3, (1,)) == "M-A-M-"


def test_forward_shape_loss_and_low_precision():
    model = debug_model()
    tokens, targets = torch.randint(0, 512, (3, 17)), torch.randint(0, 512, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, 512) and torch.isfinite(logits).all()
    with torch.no_grad():
        expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        torch.testing.assert_close(model(tokens, targets), expected, atol=1e-5, rtol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(model(tokens, targets), expected, atol=5e-2, rtol=0)
            fp32_stream = debug_model(residual_in_fp32=True)
            torch.testing.assert_close(fp32_stream(tokens, targets), expected, atol=5e-2, rtol=0)
    with pytest.raises(ValueError, match="exceeds model.args.max_seq_len 256"):
        model(torch.zeros(1, 257, dtype=torch.long))


def test_param_count_and_flops_match_hand_computation():
    a = small_args()
    D, E, H, G, N, K, V = 32, 64, 8, 2, 8, 3, 100
    mamba = D * (2 * E + 2 * G * N + H) + (E + 2 * G * N) * (K + 1) + 3 * H + E + E * D + D
    attention = D * 32 + 2 * D * 16 + 32 * D + D  # q (H·E = 32), k and v (2 KV heads of 8), o, norm
    mlp = 3 * D * 48 + D
    untied = Hybrid(a)
    total = 2 * V * D + 2 * mamba + attention + 3 * mlp + D
    assert untied.num_params() == total
    assert untied.num_params(exclude_embedding=True) == total - V * D
    tied = Hybrid(small_args(tie_embeddings=True))
    assert tied.num_params() == total - V * D and tied.num_params(exclude_embedding=True) == total - V * D
    T = 40
    ssd = 6 * (8 * (G * N + E) + 2 * E * N)  # chunk 8 < T
    assert ssd_layer_flops(a.mamba_args(), T) == ssd
    assert untied.flops_per_token(T) == 6 * (total - V * D) + 12 * 1 * D * T + 2 * ssd


@pytest.mark.parametrize("name", list(HYBRID_FLAVOURS))
def test_flavours_build_on_meta_with_their_counts_and_as_bamba(name):
    """Every flavour builds on the meta device with its documented count, equal to that of transformers'
    BambaForCausalLM of the same config (every flavour is made of Bamba layers)."""
    a = models.resolve_args(ModelConfig(arch="hybrid", flavour=name))
    with torch.device("meta"):
        model = Hybrid(a)
        bamba = transformers.BambaForCausalLM(bamba_config(a))
    expected = {"tiny-hybrid": 5_170_448, "1.2b": 1_187_272_600}
    if name in expected:
        assert model.num_params() == expected[name]
    assert model.num_params() == sum(p.numel() for p in bamba.parameters())
    shapes = {k: v.shape for k, v in model.state_dict().items()}  # the Mamba-2 in_proj / conv1d pieces stacked
    assert conversion.hf_shapes("bamba", shapes) == {k: tuple(v.shape) for k, v in bamba.state_dict().items()}
    if name == "1.2b":
        assert a.layers_pattern.replace("-", "").find("A") == 9 and a.layers_pattern[::2].count("A") == 3
        assert model.flops_per_token(2048) > 6 * model.num_params(exclude_embedding=True)


def bamba_model(a: HybridArgs, seed: int = 0) -> torch.nn.Module:
    """A random BambaForCausalLM of ``a``'s shape with its norms, D, dt_bias and conv bias moved off their init."""
    torch.manual_seed(seed)
    model = transformers.BambaForCausalLM(bamba_config(a)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".D", "dt_bias", "conv1d.bias")):
                param.add_(0.3 * torch.randn_like(param))
    return model


@torch.no_grad()
def load_bamba(a: HybridArgs, theirs: torch.nn.Module) -> tuple[Hybrid, dict[str, torch.Tensor]]:
    """A hybrid of ``a`` holding ``theirs``' weights through ``hybrid.hf.from_hf_tensor``; and their state dict."""
    ours, state = Hybrid(a), theirs.state_dict()
    for name, param in ours.named_parameters():  # a tied head once, as the embedding
        param.copy_(hybrid_hf.from_hf_tensor(state[hybrid_hf.hf_name(name)], [name], a)[name])
    return ours, state


@pytest.mark.parametrize("tie", [False, True])
def test_bamba_weights_give_equal_logits_and_map_back_exactly(tie):
    a = small_args(tie_embeddings=tie)
    theirs = bamba_model(a)
    fields = hybrid_hf.args_from_hf_config(theirs.config.to_dict(), "config.json")
    assert HybridArgs(**fields) == a
    ours, state = load_bamba(a, theirs)
    ids = torch.randint(0, 100, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)
    back = dict(hybrid_hf.to_hf_tensors(a, dict(ours.named_parameters())))
    assert set(back) == set(state) - ({"lm_head.weight"} if tie else set())
    assert all(torch.equal(back[k], state[k]) for k in back)


def test_full_rope_and_one_kv_head_also_match_bamba():
    a = small_args(rope_fraction=1.0, attn_kv_heads=1, mamba_ngroups=1, layers_pattern="A-M-")
    theirs = bamba_model(a, seed=3)
    ours, _ = load_bamba(a, theirs)
    ids = torch.randint(0, 100, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ({"layers_pattern": "MMA-"}, r"layers_pattern 'MMA-' is not Bamba layers"),
        ({"layers_pattern": "M-A"}, r"layers_pattern 'M-A' is not Bamba layers"),
        ({"mlp": "gelu"}, r"mlp 'gelu' \(Bamba's MLP is SwiGLU\)"),
        ({"attn_pos_encoding": "none"}, r"attn_pos_encoding 'none' \(Bamba's attention applies RoPE\)"),
    ],
)
def test_export_refuses_what_bamba_cannot_hold_in_one_line(override, why):
    a = small_args(**override)
    with pytest.raises(ConfigError, match=rf"^export --format hf: BambaForCausalLM cannot hold this hybrid: {why}"):
        hf_family("hybrid", a)
    assert hf_family("hybrid", small_args()) == "bamba"


def test_import_refuses_what_the_hybrid_does_not_compute():
    config = bamba_model(small_args()).config.to_dict()
    for change, message in (
        ({"time_step_limit": [0.0, 0.5]}, r"time_step_limit=\[0\.0, 0\.5\]"),
        ({"mamba_proj_bias": True}, r"mamba_proj_bias=True; anytrain's model needs False"),
        ({"mamba_n_heads": 4, "mamba_d_head": 8}, r"mamba_n_heads·mamba_d_head = 4·8 != mamba_expand·hidden_size"),
    ):
        with pytest.raises(ConfigError, match=rf"^model\.init_from: config\.json has {message}"):
            hybrid_hf.args_from_hf_config({**config, **change}, "config.json")


def test_causal_and_no_rope_variant():
    for kw in ({}, {"attn_pos_encoding": "none"}):
        model = debug_model(**kw)
        a = torch.randint(0, 512, (2, 20))
        b = a.clone()
        b[:, 9:] = torch.randint(0, 512, (2, 11))
        with torch.no_grad():
            la, lb = model(a), model(b)
        torch.testing.assert_close(la[:, :9], lb[:, :9], atol=1e-6, rtol=0)
        assert not torch.allclose(la[:, 9:], lb[:, 9:])
    assert debug_model(attn_pos_encoding="none").backbone.rope_cos is None


@pytest.mark.parametrize("kw", [{}, {"attn_pos_encoding": "none"}, {"rope_fraction": 0.5}], ids=str)
def test_document_mask_gives_each_document_its_own_outputs(kw):
    """With document_eos_id set, every document of a packed row (EOS-terminated, the last cut off) has the logits
    it has alone: attention stays inside it with RoPE positions restarting, and the Mamba-2 blocks' conv window and
    SSD state restart after each EOS; without it the later documents differ."""
    eos = 3
    model = debug_model(seed=2, **kw)
    assert model.args.has("A") and model.args.has("M")
    docs = packed_documents(eos, (5, 1, 12, 7))
    row = torch.cat(docs)[None]  # (1, 28)
    with torch.no_grad():
        plain = model(row)
        model.document_eos_id = eos
        packed = model(torch.cat([row, row.flip(1)]))  # two rows with their boundaries in different places
        alone = torch.cat([model(d[None]) for d in docs], dim=1)
        alone_flipped = torch.cat([model(d[None]) for d in split_documents(row.flip(1)[0], eos)], dim=1)
    torch.testing.assert_close(packed[:1], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[1:], alone_flipped, rtol=0, atol=1e-5)
    torch.testing.assert_close(plain[:, :6], packed[:1, :6], rtol=0, atol=1e-6)  # the first document is unchanged
    assert not torch.allclose(plain[:, 6:], packed[:1, 6:], atol=1e-3)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_document_mask_gpu_dispatch_equals_documents_alone(monkeypatch):
    """The GPU path of the attention blocks (a document BlockMask into flex_attention; eager flex here, the kernel's
    math) on CPU tensors gives every document its outputs alone too."""
    from torch.nn.attention.flex_attention import flex_attention

    from anytrain import hardware
    from anytrain.models import layers

    eos, model = 3, debug_model(seed=4)
    docs = packed_documents(eos, (6, 9, 4), seed=1)
    row = torch.cat(docs)[None]
    with torch.no_grad():
        model.document_eos_id = eos
        alone = torch.cat([model(d[None]) for d in docs], dim=1)
        monkeypatch.setattr(layers, "_FLEX_ATTENTION", flex_attention)
        monkeypatch.setattr(hardware, "is_gpu", lambda device=None: True)
        packed = model(row)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_document_mask_is_accepted_for_hybrids():
    from anytrain.config import RunConfig, check_document_mask

    cfg = RunConfig(model=ModelConfig(arch="hybrid", flavour="debug"))
    cfg.data.document_mask = True
    check_document_mask(cfg)
    cfg.parallel.pp = 2
    with pytest.raises(ConfigError, match=r"^data\.document_mask: not available with pipeline parallelism"):
        check_document_mask(cfg)


def _meta_then_init(seed: int, tie: bool) -> Hybrid:
    with torch.device("meta"):
        model = Hybrid(HybridArgs(**{**HYBRID_FLAVOURS["debug"], "tie_embeddings": tie}))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_init_weights_after_to_empty_is_complete_and_deterministic(tie):
    m1, m2, m3 = _meta_then_init(7, tie), _meta_then_init(7, tie), _meta_then_init(8, tie)
    assert (m1.lm_head.weight is m1.backbone.embeddings.weight) == tie
    for key, value in m1.state_dict().items():
        assert torch.isfinite(value).all(), key
        assert torch.equal(value, m2.state_dict()[key]), key
    assert not torch.equal(m1.backbone.embeddings.weight, m3.backbone.embeddings.weight)
    fresh = debug_model()
    assert torch.equal(m1.backbone.rope_cos, fresh.backbone.rope_cos)  # rebuilt after to_empty
    assert torch.equal(m1.backbone.rope_sin, fresh.backbone.rope_sin)
    # out projections of every block scaled by 1/sqrt(L) (L = 4 blocks)
    attention = m1.blocks()[2].attention
    assert abs(attention.wo.weight.std().item() - 0.01) < 0.003 and abs(attention.wq.weight.std().item() - 0.02) < 0.003


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
    assert models.spec_of(first).name == "hybrid" and [b.kind for b in last.blocks()] == ["A", "-"]
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens), targets=tokens), model(tokens, targets=tokens), rtol=0, atol=0)
        torch.testing.assert_close(last(first(tokens)), model(tokens), rtol=0, atol=0)


def test_generate_appends_tokens():
    out = debug_model().generate(torch.tensor([[1, 2, 3]]), 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and torch.equal(out[:, :3], torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"layers_pattern": "MXA"}, "layers_pattern"),
        ({"layers_pattern": ""}, "layers_pattern"),
        ({"attn_heads": 5}, "attn_heads"),
        ({"attn_kv_heads": 3}, "attn_kv_heads"),
        ({"rope_fraction": 0.3}, "rope_fraction"),
        ({"mamba_headdim": 24}, "mamba_headdim"),
        ({"mamba_ngroups": 3}, "mamba_ngroups"),
        ({"mamba_d_conv": 5}, "mamba_d_conv"),
        ({"attn_pos_encoding": "alibi"}, "attn_pos_encoding"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_bad_args_raise_config_error_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=rf"^model\.args\.{field}:"):
        models.resolve_args(ModelConfig(arch="hybrid", flavour="debug", args=override))


def test_registry_builds_flavours_and_rejects_unknown_fields():
    assert isinstance(models.build_model(ModelConfig(arch="hybrid", flavour="debug")), Hybrid)
    assert set(models.list_flavours()["hybrid"]) == {"debug", "tiny-hybrid", "1.2b"}
    with pytest.raises(ConfigError, match=r"model\.args\.n_layers: unknown field"):
        models.resolve_args(ModelConfig(arch="hybrid", flavour="debug", args={"n_layers": 4}))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_wraps_every_block_kind_and_keeps_the_gradients(policy):
    from anytrain.parallel.ac import apply_activation_checkpointing

    plain, wrapped = debug_model(), debug_model()
    apply_activation_checkpointing(wrapped, policy)
    assert len(wrapped.blocks()) == 4 and set(wrapped.state_dict()) == set(plain.state_dict())
    batch = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    for model in (plain, wrapped):
        model(batch[:, :-1], batch[:, 1:]).backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        (dict(mamba_headdim=64), 4, "the Mamba-2 head count 2 (expand·d_model / model.args.mamba_headdim)"),
        (dict(mamba_ngroups=2), 4, "model.args.mamba_ngroups 2 (B and C are split by groups)"),
        (dict(attn_kv_heads=1), 2, "model.args.attn_heads 4 / attn_kv_heads 1"),
        (dict(ffn_dim=129), 2, "model.args.ffn_dim 129"),
    ],
)
def test_tensor_parallel_degrees_a_block_cannot_split_are_one_line_naming_the_field(overrides, tp, message):
    from anytrain.models.hybrid.parallelize import check_tensor_parallel

    a = HybridArgs(**{**HYBRID_FLAVOURS["debug"], **overrides})  # 8 Mamba-2 heads, 4 / 2 attention heads, F 128
    check_tensor_parallel(HybridArgs(**HYBRID_FLAVOURS["debug"]), 2)
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(a, tp)
    assert str(err.value) == f"parallel.tp: {tp} does not divide {message}; choose a divisor"
