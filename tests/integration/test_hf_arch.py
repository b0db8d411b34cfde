"""``model.arch: hf``: tiny random transformers models (GPT-2, Llama, Qwen2 shapes, made here with save_pretrained)
trained by anytrain's trainer on 2 gloo ranks (DDP and FSDP2 per decoder layer) with falling validation loss, a
checkpoint, an exact resume and an export that transformers loads with equal logits; config errors; the fused-loss
probe; SFT from JSONL end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from anytrain.config import load_config
from anytrain.data.resolve import resolve_run_config
from anytrain.errors import ConfigError
from tests.conftest import cli_in_process, run_cli

transformers = pytest.importorskip("transformers")

STEPS = 10


def tiny_config(shape: str):
    """A 2-layer model of vocabulary 512 (small_data's tokenizer), no dropout, special ids inside the vocabulary."""
    common = dict(vocab_size=512, bos_token_id=0, eos_token_id=0)
    if shape == "gpt2":
        return transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common
        )
    if shape == "llama":
        return transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        )
    if shape == "qwen2":
        return transformers.Qwen2Config(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            **common,
        )
    if shape == "gemma2":  # logits soft-capped after the head: the fused loss must not be used
        return transformers.Gemma2Config(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            final_logit_softcapping=0.5,
            pad_token_id=0,
            **common,
        )
    raise ValueError(shape)


def save_model(shape: str, folder: Path, tokenizer_file: Path | None = None) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config(shape)).save_pretrained(folder)
    if tokenizer_file is not None:  # the folder ships its tokenizer, as a hub download does
        transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_file), eos_token="<|endoftext|>"
        ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory, small_data) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_models")
    return {
        shape: save_model(shape, root / shape, small_data / "tokenizer.json" if shape == "llama" else None)
        for shape in ("gpt2", "llama", "qwen2", "gemma2")
    }


def train_args(data: Path, hf_path: Path, steps: int = STEPS) -> list[str]:
    return [
        "--model.arch",
        "hf",
        "--model.hf_path",
        str(hf_path),
        "--data.path",
        str(data),
        "--data.seq_len",
        "32",
        "--train.global_batch",
        "4",
        "--train.steps",
        str(steps),
        "--train.log_interval",
        "1",
        "--train.eval_batches",
        "1",
        "--train.eval_interval",
        "0",
        "--train.dtype",
        "fp32",
        "--train.warmup_steps",
        "1",
        "--train.lr",
        "3e-3",
        "--train.schedule",
        "constant",
        "--device",
        "cpu",
    ]


def records(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def torchrun(run_dir: Path, *args: str) -> None:
    proc = run_cli("train", "configs/tiny.yaml", "--run-dir", str(run_dir), *args, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def hf_logits_equal(run_dir: Path, out: Path, vocab: int = 512) -> None:
    from anytrain.checkpoint.export import export_hf
    from anytrain.checkpoint.run_model import load_run_model

    export_hf(run_dir, out)
    _, ours, _ = load_run_model(run_dir, torch.device("cpu"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs) is type(ours.hf)
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "shape, strategy",
    [
        ("llama", "fsdp"),
        pytest.param("gpt2", "ddp", marks=pytest.mark.slow),
        pytest.param("llama", "ddp", marks=pytest.mark.slow),
        pytest.param("gpt2", "fsdp", marks=pytest.mark.slow),
        pytest.param("qwen2", "ddp", marks=pytest.mark.slow),
        pytest.param("qwen2", "fsdp", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_train_resume_exactly_and_export(tmp_path, small_data, hf_models, shape, strategy):
    """10 steps on 2 gloo ranks: the validation loss falls; resuming from the step-5 checkpoint gives the same losses
    for steps 6-10 bit for bit; the export loads in transformers (same class) with equal logits."""
    args = [*train_args(small_data, hf_models[shape]), "--parallel.strategy", strategy, "--checkpoint.interval", "5"]
    run = tmp_path / "run"
    torchrun(run, *args)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == strategy and summary["world_size"] == 2
    assert summary["final_val_loss"] < summary["first_val_loss"] - 0.1
    train = records(run, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))

    resumed = tmp_path / "resumed"  # the same run stopped after its step-5 checkpoint, then resumed
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000010")
    torchrun(resumed, *args, "--resume")
    again = records(resumed, "train")[STEPS:]
    assert [r["step"] for r in again] == list(range(6, STEPS + 1))
    assert [r["loss"] for r in again] == [r["loss"] for r in train[5:]]
    assert [r["grad_norm"] for r in again] == [r["grad_norm"] for r in train[5:]]
    hf_logits_equal(run, tmp_path / "export")


def run_in_process(data: Path, hf_path: Path, run_dir: Path, *extra: str, steps: int = 3) -> dict:
    from anytrain.train.trainer import run_training

    return run_training(
        load_config("configs/tiny.yaml", train_args(data, hf_path, steps) + list(extra)), run_dir=str(run_dir)
    )


def test_export_ships_the_folders_tokenizer(tmp_path, small_data, hf_models):
    """llama's folder holds tokenizer files: the export carries them (and the config of the folder's class)."""
    run_in_process(small_data, hf_models["llama"], tmp_path / "run", steps=1)
    out = tmp_path / "export"
    hf_logits_equal(tmp_path / "run", out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>"
    source = json.loads((hf_models["llama"] / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    for key in ("architectures", "hidden_size", "num_key_value_heads", "intermediate_size", "rope_parameters"):
        assert exported.get(key) == source.get(key), key


def test_activation_checkpointing_gives_the_same_loss_and_gradients(small_data, hf_models):
    """Full activation checkpointing wraps every decoder layer found in the module tree; loss and gradients equal."""
    from anytrain.models import build_model
    from anytrain.parallel.ac import apply_activation_checkpointing

    cfg = resolve_run_config(load_config("configs/tiny.yaml", train_args(small_data, hf_models["qwen2"])))
    plain, checkpointed = build_model(cfg.model), build_model(cfg.model)
    assert [type(b).__name__ for b in plain.blocks()] == ["Qwen2DecoderLayer"] * 2
    apply_activation_checkpointing(checkpointed, "full")
    assert [type(b).__name__ for b in checkpointed.blocks()] == ["CheckpointWrapper"] * 2
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = [model(ids[:, :-1], ids[:, 1:]) for model in (plain, checkpointed)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in checkpointed.named_parameters()}
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=1e-7)


@pytest.mark.slow
def test_compile_matches_eager(tmp_path, small_data, hf_models):
    eager = run_in_process(small_data, hf_models["llama"], tmp_path / "eager")
    compiled = run_in_process(small_data, hf_models["llama"], tmp_path / "compiled", "--train.compile", "true")
    assert compiled["final_val_loss"] == pytest.approx(eager["final_val_loss"], abs=1e-4)


def test_random_init_is_seeded_and_differs_from_the_folder(small_data, hf_models):
    from anytrain.models import build_model

    def built(*extra):
        cfg = resolve_run_config(
            load_config("configs/tiny.yaml", train_args(small_data, hf_models["gpt2"]) + list(extra))
        )
        return build_model(cfg.model).state_dict()

    pretrained = built()
    first = built("--model.args.init", "random")
    name = "hf.transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(first[name], pretrained[name])
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_models["gpt2"]).state_dict()
    assert torch.equal(pretrained[name], ref[name[3:]])
    torch.manual_seed(1)  # build_model seeds nothing: the class init draws from the global generator
    again = built("--model.args.init", "random")
    torch.manual_seed(1)
    assert all(torch.equal(again[k], v) for k, v in built("--model.args.init", "random").items())
    assert first[name].std() == pytest.approx(0.02, rel=0.2)  # GPT-2's own initializer_range


def test_flops_and_params_formula(small_data, hf_models):
    from anytrain.models import REGISTRY, LanguageModel, build_model, spec_of

    cfg = resolve_run_config(load_config("configs/tiny.yaml", train_args(small_data, hf_models["gpt2"])))
    model = build_model(cfg.model)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_models["gpt2"])
    total = sum(p.numel() for p in ref.parameters())  # tied head counted once
    tables = ref.transformer.wte.weight.numel() + ref.transformer.wpe.weight.numel()
    assert model.num_params() == total
    assert model.num_params(exclude_embedding=True) == total - tables + ref.lm_head.weight.numel()
    assert model.flops_per_token(32) == 6 * (total - tables + 512 * 32) + 12 * 2 * 32 * 32
    assert model._blocks_name == "hf.transformer.h" and model.hidden_size == 32 and model.tie_embeddings
    assert isinstance(model, LanguageModel) and spec_of(model) is REGISTRY["hf"]


def test_fused_loss_only_where_the_head_output_is_the_logits(small_data, hf_models):
    """Llama's head output is its logits (fused linear + CE); Gemma-2 soft-caps them (the model's logits + CE): both
    give the loss of transformers' own logits."""
    from anytrain.models import build_model

    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    gemma = resolve_run_config(load_config("configs/tiny.yaml", train_args(small_data, hf_models["gemma2"])))
    with pytest.raises(ConfigError, match=r"model\.args\.attn_implementation: Gemma2ForCausalLM does not support"):
        build_model(gemma.model)  # soft-capped attention scores: no SDPA path in transformers
    for shape, fused in (("llama", True), ("gemma2", False)):
        extra = ["--model.args.attn_implementation", "eager"] if shape == "gemma2" else []
        cfg = resolve_run_config(load_config("configs/tiny.yaml", train_args(small_data, hf_models[shape]) + extra))
        model = build_model(cfg.model)
        assert model.fused_head is fused
        ref = transformers.AutoModelForCausalLM.from_pretrained(hf_models[shape]).eval()
        with torch.no_grad():
            logits = ref(ids).logits
        expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        torch.testing.assert_close(model(ids[:, :-1], ids[:, 1:]), expected, rtol=0, atol=1e-5)


def test_residual_stream_dtype_under_autocast(small_data, hf_models):
    """residual_in_fp32 false (default): the embedding outputs (GPT-2's token and position tables) take the autocast
    dtype, so every block receives bf16 hidden states; true: transformers' fp32 stream. The losses agree to bf16
    rounding, and without autocast the option changes nothing."""
    from anytrain.models import build_model

    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    losses, seen = {}, {}
    for keep in (False, True):
        cfg = resolve_run_config(
            load_config(
                "configs/tiny.yaml",
                train_args(small_data, hf_models["gpt2"]) + ["--model.args.residual_in_fp32", str(keep).lower()],
            )
        )
        model = build_model(cfg.model)
        dtypes = []
        for block in model.blocks():
            block.register_forward_pre_hook(lambda _m, args, _kw, d=dtypes: d.append(args[0].dtype), with_kwargs=True)
        with torch.no_grad():
            plain = model(ids[:, :-1], ids[:, 1:])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses[keep] = model(ids[:, :-1], ids[:, 1:]).float()
        seen[keep] = dtypes[len(model.blocks()) :]  # the autocast forward's blocks
        assert dtypes[: len(model.blocks())] == [torch.float32] * 2  # no autocast: fp32 either way
        losses[f"plain-{keep}"] = plain
    assert seen[False] == [torch.bfloat16] * 2 and seen[True] == [torch.float32] * 2
    assert losses["plain-False"] == losses["plain-True"]
    torch.testing.assert_close(losses[False], losses[True], rtol=0, atol=0.05)


@pytest.mark.parametrize("shape", ["llama", "gpt2"])
def test_compiled_attention_gets_is_causal_per_block_and_whole_body(small_data, hf_models, shape):
    """Plain causal models run transformers' SDPA attention under the adapter's registered name, which has no mask
    function: under torch.compile too (where transformers with torch < 2.14 would build a (B, 1, T, T) mask), every
    traced SDPA call has no mask, ``is_causal`` and, for GQA, ``enable_gqa`` — compiled per block and as one whole-body
    graph (``model``, what ``compile_scope: auto`` picks for such a model in one process). The loss equals the eager
    model's."""
    from anytrain.models import build_model, spec_of
    from anytrain.models.hf.adapter import CAUSAL_SDPA
    from anytrain.parallel.compile import apply_compile, resolve_compile_scope

    cfg = resolve_run_config(load_config("configs/tiny.yaml", train_args(small_data, hf_models[shape])))
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    eager = build_model(cfg.model)
    assert eager.hf.config._attn_implementation == CAUSAL_SDPA
    with torch.no_grad():
        expected = eager(ids[:, :-1], ids[:, 1:])
    for scope in ("blocks", "model"):
        model = build_model(cfg.model)
        if scope == "model":  # what compile_scope auto picks in one process for a mask-free model
            assert resolve_compile_scope("auto", "single", spec_of(model).parallelize_plan.whole_model_when_auto(model))
            assert resolve_compile_scope("auto", "single", True) == scope
        calls = []

        def backend(gm, _inputs, calls=calls):
            calls.extend(n.kwargs for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target))
            return gm.forward

        torch._dynamo.reset()
        apply_compile(model, scope)
        compiled = [b for b in model.blocks()] if scope == "blocks" else [model.hf.base_model]
        for module in compiled:  # the same graphs, through a backend that records them
            if scope == "blocks":
                module._compiled_call_impl = torch.compile(module._call_impl, backend=backend)
            else:
                module.forward = torch.compile(type(module).forward.__get__(module), backend=backend)
        with torch.no_grad():
            loss = model(ids[:, :-1], ids[:, 1:])
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
        assert calls, f"{scope}: no SDPA call traced"
        assert all(c.get("attn_mask") is None and c.get("is_causal") is True for c in calls), (scope, calls)
        if shape == "llama":  # 4 query heads on 2 K/V heads
            assert all(c.get("enable_gqa") is True for c in calls), (scope, calls)


def test_models_with_windowed_attention_keep_transformers_masks(tmp_path, small_data):
    """A sliding window (Mistral's, shorter than the sequence) keeps transformers' own SDPA masks: same loss as the
    transformers model; the mask-free name is only for plain causal configs."""
    from anytrain.models import build_model
    from anytrain.models.hf.adapter import plain_causal

    conf = transformers.MistralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=4,
        vocab_size=512,
        bos_token_id=0,
        eos_token_id=0,
    )
    assert not plain_causal(conf)
    assert plain_causal(transformers.Qwen2Config()) and plain_causal(transformers.GPT2Config())
    assert not plain_causal(transformers.Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(conf).save_pretrained(tmp_path / "mistral")
    args = train_args(small_data, tmp_path / "mistral")
    eager = build_model(
        resolve_run_config(load_config("configs/tiny.yaml", [*args, "--model.args.attn_implementation", "eager"])).model
    )
    model = build_model(resolve_run_config(load_config("configs/tiny.yaml", args)).model)
    assert model.hf.config._attn_implementation == "sdpa"
    assert eager.hf.config._attn_implementation == "eager"  # each model has its own copy of the folder's config
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mistral", attn_implementation="sdpa").eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ref(ids).logits
        loss = model(ids[:, :-1], ids[:, 1:])
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], "model.hf_path: model.arch hf needs a local Hugging Face model folder"),
        (["--model.hf_path", "{tmp}"], "has no config.json"),
        (["--model.hf_path", "{tmp}/nowhere"], "is not a directory"),
        (
            ["--model.hf_path", "{llama}", "--parallel.tp", "2"],
            "parallel.tp: model.arch hf trains with data parallelism",
        ),
        (
            ["--model.hf_path", "{llama}", "--parallel.pp", "2"],
            "parallel.pp: model.arch hf trains with data parallelism",
        ),
        (
            ["--model.hf_path", "{llama}", "--model.args.n_layers", "4"],
            "model.args.n_layers: is read from model.hf_path",
        ),
        (
            ["--model.hf_path", "{llama}", "--model.init_from", "{llama}"],
            "model.init_from: not used with model.arch hf",
        ),
        (["--model.hf_path", "{llama}", "--model.args.init", "zeros"], "model.args.init: expected one of"),
        (
            ["--model.hf_path", "{gemma2}", "--train.cuda_graphs", "true"],
            "train.cuda_graphs: with model.arch hf only for",
        ),
        (
            ["--model.hf_path", "{llama}", "--train.cuda_graphs", "true", "--model.args.attn_implementation", "eager"],
            "train.cuda_graphs: with model.arch hf only for",
        ),
    ],
)
def test_config_errors_name_the_field(tmp_path, small_data, hf_models, overrides, message):
    args = [a.format(tmp=tmp_path, llama=hf_models["llama"], gemma2=hf_models["gemma2"]) for a in overrides]
    base = ["--model.arch", "hf", "--data.path", str(small_data), "--data.seq_len", "32"]
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        resolve_run_config(load_config("configs/tiny.yaml", base + args))


def test_mask_code_decides_whole_body_compile_and_cuda_graphs(small_data, hf_models):
    """A plain causal model (no attention-mask code in its forward) is compiled as one whole body under compile_scope
    auto in one process and may be CUDA-graphed; Gemma-2 (sliding-window layers, eager attention: transformers' masks)
    is compiled per block, and its cuda_graphs is refused at config load (the test above)."""
    from anytrain.models import build_model, spec_of
    from anytrain.parallel.compile import resolve_compile_scope

    for shape, mask_free in (("llama", True), ("gpt2", True), ("gemma2", False)):
        extra = ["--train.cuda_graphs", "true"] if mask_free else ["--model.args.attn_implementation", "eager"]
        cfg = resolve_run_config(load_config("configs/tiny.yaml", [*train_args(small_data, hf_models[shape]), *extra]))
        model = build_model(cfg.model)
        assert model.mask_free is mask_free
        whole = spec_of(model).parallelize_plan.whole_model_when_auto(model)
        assert resolve_compile_scope("auto", "single", whole) == ("model" if mask_free else "blocks")
        assert resolve_compile_scope("auto", "ddp", whole) == "blocks"


def test_hf_path_without_arch_hf_and_cli_error_line(tmp_path, capsys, small_data, hf_models):
    with pytest.raises(ConfigError, match=r"model\.hf_path: only read with model\.arch hf"):
        resolve_run_config(
            load_config(
                "configs/tiny.yaml", ["--model.hf_path", str(hf_models["llama"]), "--data.path", str(small_data)]
            )
        )
    code, _, err = cli_in_process(
        capsys,
        "train",
        "configs/tiny.yaml",
        "--model.arch",
        "hf",
        "--model.hf_path",
        str(tmp_path),
        "--data.path",
        str(small_data),
    )
    assert code == 2 and err.strip().startswith("error: model.hf_path:") and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written


def test_sft_from_jsonl_end_to_end(tmp_path, capsys, small_data, hf_models):
    """prepare-sft with the model folder's tokenizer, then training: the validation loss counts completion tokens
    only (equal to a hand-computed masked CE over the validation windows) and falls."""
    lines = [
        {"prompt": f"Question {i}: who speaks?\nAnswer:", "completion": f" ROMEO speaks, line {i}."} for i in range(40)
    ] + [{"text": "ROMEO. But, soft! what light through yonder window breaks?"}] * 4
    jsonl = tmp_path / "sft.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = tmp_path / "sft"
    code, out, err = cli_in_process(
        capsys,
        "prepare-sft",
        str(jsonl),
        "--out",
        str(data),
        "--tokenizer",
        str(hf_models["llama"]),
        "--val-fraction",
        "0.2",
    )
    assert code == 0, err
    assert "trained" in out
    summary = run_in_process(data, hf_models["llama"], tmp_path / "run", "--train.eval_interval", "0", steps=8)
    assert summary["final_val_loss"] < summary["first_val_loss"]

    from anytrain.checkpoint.run_model import load_run_model
    from anytrain.data.sft import masked_sources
    from anytrain.data.shards import TokenDataset

    _, model, _ = load_run_model(tmp_path / "run", torch.device("cpu"))
    _, val = masked_sources(TokenDataset(data), 32, 4, 1234)
    inputs, targets, _ = val.rank_batch(0, 0, 1)
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(
            model(inputs).flatten(0, 1), targets.flatten().clamp(min=0), reduction="none"
        )
    trained = targets.flatten() != -100
    assert 0 < trained.sum() < trained.numel()
    assert records(tmp_path / "run", "eval")[-1]["val_loss"] == pytest.approx(losses[trained].mean().item(), abs=1e-5)
