"""What ALiBi costs against RoPE + SDPA: one GPU, MPT-1B's shape (d 2048, 24 layers, 16 heads of 128, GELU MLP,
LayerNorm, tied embeddings), sequence 2048, bf16.

Two kinds of rows, each in a fresh subprocess of this script (its own inductor cache, as bench/transformer.py):

* ``train``: ``Trainer(cfg, batches=...)`` (the product's build, ``parallelize`` with per-block compile, fused AdamW,
  ``train_step``) on random token batches, for ``pos_encoding`` alibi (compiled flex_attention with the ALiBi
  ``score_mod`` and a causal block mask) and rope (SDPA, FlashAttention), everything else equal; tokens/s, MFU
  (anytrain's flops_per_token, equal for both: position encodings add no matmul FLOPs) and peak memory;
* ``train-alibi-hfmpt``: transformers' ``MptForCausalLM`` of the same shape (the config anytrain's HF export writes
  for this model), fp32 weights, bf16 autocast, ``torch.compile``, fused AdamW, clipping, its own loss: what a user
  would train MPT with instead (issue #39's comparison; MFU with anytrain's FLOPs per token for the same model);
* ``attention``: the attention op alone, forward + backward, (B, H, T, E) = (micro-batch, 16, 2048, 128) bf16:
  ``layers.alibi_attention`` with the block mask vs ``F.scaled_dot_product_attention(is_causal=True)`` after RoPE.

Results: a table on stdout and ``--out/alibi_<device>.json`` (``alibi_smoke.json`` with ``--smoke``, whose rows run
on the CPU, where ALiBi takes the explicit-bias SDPA path: a check that the bench runs, not a measurement).

    PYTHONPATH=src python -m bench.alibi --out bench/results            # GPU: the full table (~5 minutes)
    PYTHONPATH=src python -m bench.alibi --smoke --out /tmp/alibi       # CPU check: debug shape, 2 steps, no compile
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from anytrain import hardware
from anytrain.config import ModelConfig, RunConfig
from anytrain.models import layers
from anytrain.models.llama.model import apply_rope, rope_tables
from anytrain.train.trainer import Trainer
from bench.common import (
    RandomBatches,
    bench_device,
    print_row,
    release,
    row_error,
    run_row_in_child,
    save_rows,
    timed,
)

ROWS = ["train-rope-sdpa", "train-alibi-flex", "train-alibi-hfmpt", "attention-rope-sdpa", "attention-alibi-flex"]


def shape(smoke: bool) -> dict:
    if smoke:
        return {"flavour": "mpt-debug", "seq": 64, "micro": 2, "global_batch": 4, "heads": 4, "head_dim": 16}
    return {"flavour": "mpt-1b", "seq": 2048, "micro": 4, "global_batch": 8, "heads": 16, "head_dim": 128}


def train_row(pos: str, s: dict, device: torch.device, args: argparse.Namespace) -> dict:
    cfg = RunConfig()
    cfg.model = ModelConfig(arch="transformer", flavour=s["flavour"], args={"pos_encoding": pos})
    cfg.device = "cpu" if args.smoke else "auto"
    cfg.data.seq_len = s["seq"]
    cfg.train.global_batch, cfg.train.micro_batch = s["global_batch"], s["micro"]
    cfg.train.compile, cfg.train.dtype = not args.smoke, "fp32" if args.smoke else "bf16"
    cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps = 2e-4, 100, 1000
    trainer = Trainer(cfg, batches=RandomBatches(50368 if not args.smoke else 512, s["global_batch"], s["seq"]))
    row = timed(trainer.train_step, device, args.warmup, args.steps)
    model = trainer.raw_model
    tokens = s["global_batch"] * s["seq"]
    row.update(
        params=model.num_params(),
        flops_per_token=model.flops_per_token(s["seq"]),
        tokens_per_s=tokens / row["seconds_per_step"],
        driver="Trainer.train_step",
    )
    peak = hardware.peak_flops(device)
    row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / peak if peak else None
    return row


def hf_mpt_row(s: dict, device: torch.device, args: argparse.Namespace) -> dict:
    """transformers' MptForCausalLM equal to anytrain's ``s["flavour"]`` with ALiBi, trained as bench/transformer.py
    trains HF's Llama: fp32 master weights, bf16 autocast, torch.compile (not in the smoke), fused AdamW on GPUs."""
    from transformers import MptConfig, MptForCausalLM

    from anytrain.models import build_model
    from anytrain.models.conversion import hf_config

    with torch.device("meta"):
        ours = build_model(ModelConfig(arch="transformer", flavour=s["flavour"], args={"pos_encoding": "alibi"}))
    config = hf_config("mpt", ours.args, eos_id=0, pad_id=None, dtype="float32")
    config = MptConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with torch.device(device):
        model = MptForCausalLM(config).float().train()
    gpu = hardware.is_gpu(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=gpu)
    run = torch.compile(model) if not args.smoke else model
    batches = RandomBatches(config.vocab_size, s["global_batch"], s["seq"])
    accum = s["global_batch"] // s["micro"]

    def step(i: int) -> None:
        inputs = batches.rank_batch(i)[0].to(device, non_blocking=True)
        for k in range(accum):
            x = inputs[k * s["micro"] : (k + 1) * s["micro"]]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
                loss = run(input_ids=x, labels=x).loss / accum  # HF shifts the labels itself
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    row = timed(step, device, args.warmup, args.steps)
    tokens = s["global_batch"] * s["seq"]
    row.update(
        params=sum(p.numel() for p in model.parameters()),
        flops_per_token=ours.flops_per_token(s["seq"]),
        tokens_per_s=tokens / row["seconds_per_step"],
        driver="MptForCausalLM + torch.compile",
    )
    peak = hardware.peak_flops(device)
    row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / peak if peak else None
    return row


def attention_row(pos: str, s: dict, device: torch.device, args: argparse.Namespace) -> dict:
    B, H, T, E = s["micro"], s["heads"], s["seq"], s["head_dim"]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, E, device=device, dtype=dtype, generator=gen, requires_grad=True) for _ in "qkv")
    grad = torch.randn(B, H, T, E, device=device, dtype=dtype, generator=gen)
    if pos == "alibi":
        slopes = layers.alibi_slopes(H).to(device)
        mask = layers.causal_block_mask(T, device) if hardware.is_gpu(device) else layers.alibi_distance(T, device)

        def forward():
            return layers.alibi_attention(q, k, v, slopes, mask)
    else:
        cos, sin = (t.to(device) for t in rope_tables(E, T, 10000.0))

        def forward():
            qr = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2)
            kr = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
            return F.scaled_dot_product_attention(qr, kr, v, is_causal=True)

    def step(i: int) -> None:
        forward().backward(grad)

    row = timed(step, device, args.warmup, args.steps)
    row["ms_fwd_bwd"] = 1e3 * row["seconds_per_step"]
    # causal attention FLOPs of forward + backward (QKᵀ and AV, half the square, ×3.5 with the recomputed QKᵀ)
    flops = 3.5 * 2 * 2 * B * H * T * T * E / 2
    row["tflops_per_s"] = flops / row["seconds_per_step"] / 1e12
    return row


def run_row(name: str, args: argparse.Namespace) -> dict:
    device = bench_device(args.smoke)
    release(device)
    kind, pos, impl = name.split("-", 2)
    s = shape(args.smoke)
    row = {"row": name, "kind": kind, "pos_encoding": pos, **s}
    try:
        if impl == "hfmpt":
            row.update(hf_mpt_row(s, device, args))
        else:
            row.update((train_row if kind == "train" else attention_row)(pos, s, device, args))
    except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
        row["error"] = row_error(exc)
    return row


def run_child(name: str, args: argparse.Namespace) -> dict:
    argv = ["--out", args.out, "--steps", str(args.steps), "--warmup", str(args.warmup), *(["--smoke"] * args.smoke)]
    return run_row_in_child("bench.alibi", argv, name)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'row':<24}{'ms/step':>10}{'tokens/s':>12}{'MFU':>8}{'TFLOP/s':>9}{'peak GiB':>10}{'vs rope':>9}")
    base = {r["kind"]: r["seconds_per_step"] for r in rows if r.get("pos_encoding") == "rope" and "error" not in r}
    by_name = {r["row"]: r for r in rows if "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['row']:<24}  {r['error'][:90]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        tflops = f"{r['tflops_per_s']:.0f}" if "tflops_per_s" in r else ""
        tokens = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else ""
        ratio = f"{r['seconds_per_step'] / base[r['kind']]:.2f}x" if r["kind"] in base else ""
        print(
            f"{r['row']:<24}{1e3 * r['seconds_per_step']:>10.1f}{tokens:>12}{mfu:>8}{tflops:>9}"
            f"{r['peak_mem_gib']:>10.1f}{ratio:>9}"
        )
    ours, hf = by_name.get("train-alibi-flex"), by_name.get("train-alibi-hfmpt")
    if ours and hf:
        speedup = hf["seconds_per_step"] / ours["seconds_per_step"]
        print(f"anytrain MPT (ALiBi) vs MptForCausalLM + torch.compile: {speedup:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results", help="directory for alibi_<device>.json")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--rows", nargs="*", default=ROWS, choices=ROWS)
    parser.add_argument("--smoke", action="store_true", help="CPU check: debug shape, 2 steps, no compile")
    parser.add_argument("--one-row", default=None, help=argparse.SUPPRESS)  # a child: run this row, print it
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup = 2, 1
    if args.one_row:
        print_row(run_row(args.one_row, args))
        return
    rows = [run_child(name, args) for name in args.rows]
    print_table(rows)
    save_rows("alibi", args.out, rows, args.smoke)


if __name__ == "__main__":
    main()
