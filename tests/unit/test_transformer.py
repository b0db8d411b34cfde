import pytest
import torch

from anytrain.config import ModelConfig
from anytrain.errors import ConfigError
from anytrain.models import build_model, list_flavours, resolve_args
from anytrain.models.llama.model import Transformer, TransformerArgs, apply_rope, rope_tables
from tests.conftest import autocast_block_outputs


def small_args(**kw):
    base = dict(vocab_size=100, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
    return TransformerArgs(**{**base, **kw})


def test_forward_shape_and_dtype():
    torch.manual_seed(0)
    model = Transformer(small_args())
    logits = model(torch.randint(0, 100, (3, 17)))
    assert logits.shape == (3, 17, 100) and logits.dtype == torch.float32


def test_param_count_matches_hand_computation():
    a = small_args()
    model = Transformer(a)
    head_dim = a.dim // a.n_heads  # 8
    attn = a.dim * a.n_heads * head_dim + 2 * a.dim * a.n_kv_heads * head_dim + a.n_heads * head_dim * a.dim
    ffn = 3 * a.dim * a.ffn_dim
    per_layer = attn + ffn + 2 * a.dim
    expected = a.vocab_size * a.dim * 2 + a.n_layers * per_layer + a.dim
    assert attn == 32 * 32 + 2 * 32 * 16 + 32 * 32 == 3072
    assert model.num_params() == expected == 100 * 64 + 2 * (3072 + 4608 + 64) + 32
    assert model.num_params(exclude_embedding=True) == expected - 100 * 32


def test_flops_per_token_convention():
    a = small_args()
    model = Transformer(a)
    n = model.num_params(exclude_embedding=True)
    assert model.flops_per_token(64) == 6 * n + 12 * 2 * 32 * 64


def test_tied_embeddings_count_head_in_flops():
    model = Transformer(small_args(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = Transformer(small_args())
    assert model.num_params() == untied.num_params() - 100 * 32
    assert model.num_params(exclude_embedding=True) == untied.num_params(exclude_embedding=True)


def test_tinyllama_shape_param_count():
    args = resolve_args(ModelConfig(arch="transformer", flavour="1.1b"))
    with torch.device("meta"):
        model = Transformer(args)
    assert model.num_params() == 1_100_048_384  # TinyLlama-1.1B's published count


def test_causality():
    torch.manual_seed(0)
    model = Transformer(small_args())
    x = torch.randint(0, 100, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 100
    assert torch.allclose(model(x)[0, :8], model(y)[0, :8], atol=1e-6)
    assert not torch.allclose(model(x)[0, 8:], model(y)[0, 8:])


def test_rope_preserves_norm_and_is_relative():
    cos, sin = rope_tables(8, 16, 10000.0)
    q = torch.randn(1, 16, 1, 8)
    rq = apply_rope(q, cos, sin)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    # <R_m q, R_n k> depends only on m - n
    k = torch.randn(1, 1, 1, 8)
    qs, ks = q[:, :1].expand(1, 16, 1, 8), k.expand(1, 16, 1, 8)
    rq, rk = apply_rope(qs, cos, sin), apply_rope(ks, cos, sin)
    assert torch.allclose((rq[0, 5] * rk[0, 3]).sum(), (rq[0, 9] * rk[0, 7]).sum(), atol=1e-5)


def test_rope_rotates_interleaved_pairs():
    """The convention checkpoints depend on (Meta's interleaved pairs; HF export permutes q/k for HF's halves):
    (x[2i], x[2i+1]) rotated by t·theta^(-2i/E), forward and backward, against the pairwise formula in float64."""
    E, T = 8, 5
    cos, sin = rope_tables(E, T, 10000.0)
    x = torch.randn(2, T, 3, E, dtype=torch.float64, requires_grad=True)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, E, 2) / E)  # (T, E/2)
    c, s = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    expected = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    got = apply_rope(x, cos, sin)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # fp32 tables
    g = torch.randn_like(got)
    torch.testing.assert_close(
        torch.autograd.grad(got, x, g)[0], torch.autograd.grad(expected, x, g)[0], rtol=1e-6, atol=1e-6
    )


def test_flavours_and_arg_errors():
    assert {"debug", "tiny", "125m", "1.1b"} <= set(list_flavours()["transformer"])
    with pytest.raises(ConfigError, match="model.flavour: unknown flavour 'huge'"):
        resolve_args(ModelConfig(flavour="huge"))
    with pytest.raises(ConfigError, match="model.args.n_kv_heads: 3 does not divide n_heads 8"):
        resolve_args(ModelConfig(flavour="tiny", args={"n_kv_heads": 3}))
    with pytest.raises(ConfigError, match="model.args.dimm: unknown field"):
        resolve_args(ModelConfig(flavour="tiny", args={"dimm": 3}))
    with pytest.raises(ConfigError, match="model.arch: unknown architecture"):
        build_model(ModelConfig(arch="rnn"))


def test_generate_extends_prompt():
    torch.manual_seed(0)
    model = Transformer(small_args())
    out = model.generate(torch.tensor([[1, 2, 3]]), 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and out[0, :3].tolist() == [1, 2, 3]


def test_residual_stream_dtype_under_autocast():
    """Default: the residual stream takes the autocast dtype (bf16 saved activations); residual_in_fp32 keeps fp32.
    Both compute the same loss up to bf16 rounding; without autocast nothing changes."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    shape = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4)
    bf16_model = Transformer(TransformerArgs(**shape))
    fp32_model = Transformer(TransformerArgs(**shape, residual_in_fp32=True))
    fp32_model.load_state_dict(bf16_model.state_dict())
    block_out, losses, plain = autocast_block_outputs(
        {"bf16": bf16_model, "fp32": fp32_model}, lambda m: m.layers["1"], tokens
    )
    assert plain == {"bf16": torch.float32, "fp32": torch.float32}  # no autocast: fp32 throughout
    assert (block_out["bf16"].dtype, block_out["fp32"].dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(losses["bf16"], losses["fp32"], rtol=0, atol=2e-2)


def test_compiled_body_is_one_graph():
    """``compile_scope: model`` compiles the body as ONE graph: a graph break (an import, a host read of a tensor) in
    the forward would split it and cost the fusions across block boundaries (as one did in the Mamba blocks)."""
    model = Transformer(small_args())
    model.init_weights()
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(model.forward_hidden, fullgraph=True, backend="eager")(tokens)
    assert out.shape[:2] == (2, 16)
