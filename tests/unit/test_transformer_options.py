"""The Transformer's options (position encoding, norm, MLP, biases, tied embeddings, GQA/MQA, QK-norm): each (fp32)
against a straightforward float64 reference forward written here from the formulas, their parameter / FLOP counts
against the cost model and closed forms, the ALiBi kernels against each other, and the recipes' documented sizes."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from anytrain.config import ModelConfig, load_config
from anytrain.cost.shapes import ModelShape, shape_from_config
from anytrain.errors import ConfigError
from anytrain.models import build_model, layers, resolve_args
from anytrain.models.llama.model import Transformer, TransformerArgs

ROOT = Path(__file__).resolve().parents[2]
BASE = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=48, max_seq_len=16, init_std=0.2)
OPTIONS = {
    "llama": {},
    "alibi": {"pos_encoding": "alibi"},
    "learned": {"pos_encoding": "learned"},
    "layernorm": {"norm": "layernorm"},
    "layernorm_bias": {"norm": "layernorm", "norm_bias": True},
    "gelu": {"mlp": "gelu"},
    "bias": {"bias": True},
    "tied": {"tie_embeddings": True},
    "gqa": {"n_kv_heads": 2},
    "mqa": {"n_kv_heads": 1},
    "qk_norm": {"qk_norm": True},
    "mpt": {"pos_encoding": "alibi", "norm": "layernorm", "mlp": "gelu", "tie_embeddings": True},
    "gpt2": {
        "pos_encoding": "learned",
        "norm": "layernorm",
        "norm_bias": True,
        "mlp": "gelu",
        "bias": True,
        "qk_norm": True,
        "n_kv_heads": 2,
    },
}


def make(**options) -> Transformer:
    """A small fp32 model with every parameter (norm weights and biases too) moved off its initial value."""
    torch.manual_seed(0)
    model = Transformer(TransformerArgs(**{**BASE, **options}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


# --------------------------------------------------------------------------------------------------------------------
# the reference: one token sequence at a time, written from the formulas


def ref_norm(x, p, name, args):
    if args.norm == "rmsnorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + args.norm_eps) * p[f"{name}.weight"]
    centred = x - x.mean(-1, keepdim=True)
    y = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + args.norm_eps) * p[f"{name}.weight"]
    return y + p[f"{name}.bias"] if args.norm_bias else y


def ref_linear(x, p, name):
    y = x @ p[f"{name}.weight"].T
    return y + p[f"{name}.bias"] if f"{name}.bias" in p else y


def ref_rope(x, theta):
    """x (T, H, E): element pairs (2i, 2i+1) as complex numbers, multiplied by exp(i·t·theta^(-2i/E))."""
    T, H, E = x.shape
    pairs = torch.view_as_complex(x.reshape(T, H, E // 2, 2).contiguous())
    angles = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, E, 2, dtype=torch.float64) / E)
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)[:, None]).reshape(T, H, E)


def ref_attention(x, p, name, args):
    T, H, K, E = x.shape[0], args.n_heads, args.n_kv_heads, args.dim // args.n_heads
    q = ref_linear(x, p, f"{name}.wq").view(T, H, E)
    k = ref_linear(x, p, f"{name}.wk").view(T, K, E)
    v = ref_linear(x, p, f"{name}.wv").view(T, K, E)
    if args.qk_norm:
        q, k = ref_norm(q, p, f"{name}.q_norm", args), ref_norm(k, p, f"{name}.k_norm", args)
    if args.pos_encoding == "rope":
        q, k = ref_rope(q, args.rope_theta), ref_rope(k, args.rope_theta)
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)  # head h reads kv head h // (H/K)
    scores = torch.einsum("ihe,jhe->hij", q, k) / math.sqrt(E)  # (H, T, T)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    if args.pos_encoding == "alibi":  # Press et al.: slope 2^(-8(h+1)/H) for a power-of-two H, bias -slope·(i - j)
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float64)
        scores = scores - slopes[:, None, None] * (i - j)
    scores = scores.masked_fill(j > i, float("-inf"))
    out = torch.einsum("hij,jhe->ihe", scores.softmax(-1), v).reshape(T, H * E)
    return ref_linear(out, p, f"{name}.wo")


def ref_mlp(x, p, name, args):
    up = ref_linear(x, p, f"{name}.w1")
    if args.mlp == "gelu":
        return ref_linear(0.5 * up * (1 + torch.erf(up / math.sqrt(2))), p, f"{name}.w2")
    gate = up * torch.sigmoid(up)
    return ref_linear(gate * ref_linear(x, p, f"{name}.w3"), p, f"{name}.w2")


def reference_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """float64 logits (B, T, V) of ``model``'s parameters."""
    args = model.args
    p = {name: t.detach().double() for name, t in model.named_parameters(remove_duplicate=False)}
    out = []
    for row in ids:
        h = p["tok_embeddings.weight"][row]
        if args.pos_encoding == "learned":
            h = h + p["pos_embeddings.weight"][: len(row)]
        for i in range(args.n_layers):
            h = h + ref_attention(ref_norm(h, p, f"layers.{i}.attention_norm", args), p, f"layers.{i}.attention", args)
            h = h + ref_mlp(ref_norm(h, p, f"layers.{i}.ffn_norm", args), p, f"layers.{i}.feed_forward", args)
        out.append(ref_norm(h, p, "norm", args) @ p["output.weight"].T)
    return torch.stack(out)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_matches_reference_forward(name):
    model = make(**OPTIONS[name])
    ids = torch.randint(0, BASE["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).double(), reference_logits(model, ids), rtol=0, atol=1e-5)


def test_option_parameters_exist_as_described():
    names = set(dict(make(**OPTIONS["gpt2"]).named_parameters()))
    assert {
        "pos_embeddings.weight",
        "layers.0.attention.wq.bias",
        "layers.0.attention.q_norm.bias",
        "layers.0.feed_forward.w2.bias",
        "norm.bias",
    } <= names
    assert not any(".w3." in n for n in names)
    mpt = set(dict(make(**OPTIONS["mpt"]).named_parameters()))
    assert not any(n.endswith(".bias") or "pos_embeddings" in n for n in mpt)
    tied = make(tie_embeddings=True)
    assert tied.output.weight is tied.tok_embeddings.weight


def test_loss_path_equals_logits_path_with_options():
    model = make(**OPTIONS["gpt2"])
    ids = torch.randint(0, BASE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids[:, :-1])
        expected = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        torch.testing.assert_close(model(ids[:, :-1], ids[:, 1:]), expected, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# ALiBi: slopes, and the GPU kernel path (flex_attention score_mod + block mask) against the CPU one (SDPA + bias)


def test_alibi_slopes():
    torch.testing.assert_close(layers.alibi_slopes(8), 2.0 ** -torch.arange(1.0, 9.0))
    # not a power of two: the odd then even slopes of the next power of two (MPT / transformers), first H of them
    eight = layers.alibi_slopes(8)
    torch.testing.assert_close(layers.alibi_slopes(6), torch.cat([eight[1::2], eight[::2]])[:6])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_alibi_flex_path_equals_explicit_bias_path(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(layers, "_FLEX_ATTENTION", flex_attention)  # eager flex on CPU: same math as the kernel
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 6, 24, 8, generator=gen) for _ in range(3))
    slopes = layers.alibi_slopes(6)
    explicit = layers.alibi_attention(q, k, v, slopes, layers.alibi_distance(24))
    flex = layers.alibi_attention(q, k, v, slopes, layers.causal_block_mask(24, torch.device("cpu")))
    torch.testing.assert_close(flex, explicit, rtol=0, atol=1e-5)
    # grouped-query attention: 6 query heads over 2 K/V heads
    kv = k[:, :2], v[:, :2]
    explicit = layers.alibi_attention(q, *kv, slopes, layers.alibi_distance(24), enable_gqa=True)
    flex = layers.alibi_attention(q, *kv, slopes, layers.causal_block_mask(24, torch.device("cpu")), enable_gqa=True)
    torch.testing.assert_close(flex, explicit, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# counts


@pytest.mark.parametrize("name", list(OPTIONS))
def test_counts_match_cost_model_and_formula(name):
    args = TransformerArgs(**{**BASE, **OPTIONS[name]})
    with torch.device("meta"):
        model = Transformer(args)
    shape = ModelShape.from_args(args)
    assert shape.num_params == model.num_params()
    assert shape.dense_params() == model.num_params(exclude_embedding=True)
    for seq in (16, 2048):
        expected = 6.0 * model.num_params(exclude_embedding=True) + 12.0 * args.n_layers * args.dim * seq
        assert model.flops_per_token(seq) == shape.flops_per_token(seq) == expected


def test_option_count_differences():
    """What each option adds, from its formula: GELU drops w3 (L·D·F), biases add their widths, learned positions
    add parameters but no FLOPs, ALiBi adds neither."""
    L, D, F_, T = BASE["n_layers"], BASE["dim"], BASE["ffn_dim"], 16
    llama = make()
    count = {name: make(**OPTIONS[name]) for name in ("alibi", "learned", "gelu", "bias", "layernorm_bias", "qk_norm")}
    assert count["alibi"].num_params() == llama.num_params()
    assert count["alibi"].flops_per_token(T) == llama.flops_per_token(T)
    assert count["learned"].num_params() == llama.num_params() + BASE["max_seq_len"] * D
    assert count["learned"].flops_per_token(T) == llama.flops_per_token(T)
    assert count["gelu"].num_params() == llama.num_params() - L * D * F_
    assert count["bias"].num_params() == llama.num_params() + L * (4 * D + 2 * F_ + D)  # q k v o, w1 w3, w2
    assert count["layernorm_bias"].num_params() == llama.num_params() + (2 * L + 1) * D
    assert count["qk_norm"].num_params() == llama.num_params() + L * 2 * (D // BASE["n_heads"])


# --------------------------------------------------------------------------------------------------------------------
# validation


def test_bad_options_are_one_clear_error():
    with pytest.raises(ConfigError, match="model.args.norm_bias: RMSNorm has no bias"):
        resolve_args(ModelConfig(arch="transformer", flavour="debug", args={"norm_bias": True}))
    with pytest.raises(ConfigError, match="model.args.pos_encoding"):
        resolve_args(ModelConfig(arch="transformer", flavour="debug", args={"pos_encoding": "sinusoidal"}))
    with pytest.raises(ConfigError, match="model.args.mlp"):
        resolve_args(ModelConfig(arch="transformer", flavour="debug", args={"mlp": "relu"}))


def test_gelu_default_width_is_four_times_dim():
    assert TransformerArgs(dim=96, mlp="gelu").ffn_dim == 384
    assert TransformerArgs(dim=96).ffn_dim == 256  # SwiGLU: 8/3·D rounded up to 64


# --------------------------------------------------------------------------------------------------------------------
# recipes

RECIPES = ["mpt-125m", "mpt-350m", "mpt-760m", "mpt-1b", "mpt-3b", "mpt-7b", "mamba-1.6b", "llama-1b", "llama-3b"]


def documented_params(recipe: Path) -> int:
    match = re.search(r"^# parameters: ([\d,]+)", recipe.read_text(), re.M)
    assert match, f"{recipe} has no '# parameters: N' line"
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_on_meta_with_documented_size(name):
    recipe = ROOT / "configs" / f"{name}.yaml"
    cfg = load_config(str(recipe), [])
    with torch.device("meta"):
        model = build_model(cfg.model)
    count = model.num_params()
    assert abs(count - documented_params(recipe)) <= 0.01 * documented_params(recipe)
    assert shape_from_config(cfg).num_params == count
    assert cfg.data.seq_len == 2048
    if name.startswith("mpt-"):  # MPT's closed form: V·d + L·(12·d² + 2·d) + d (tied, no biases, scale-only norms)
        a = model.args
        assert count == a.vocab_size * a.dim + a.n_layers * (12 * a.dim**2 + 2 * a.dim) + a.dim
        assert (a.pos_encoding, a.norm, a.norm_bias, a.mlp, a.bias, a.tie_embeddings) == (
            "alibi",
            "layernorm",
            False,
            "gelu",
            False,
            True,
        )
