"""What document masking (``data.document_mask``) costs: one GPU, a train step with and without it at ~1B, sequence
2048, bf16, on packed batches of random documents.

Rows, each in a fresh subprocess of this script (its own inductor cache, as bench/alibi.py), all ``Trainer(cfg,
batches=...)`` (the product's build: ``parallelize`` with per-block compile, fused AdamW, ``train_step``) on the same
packed token batches (documents of geometric length with mean ``--doc-len``, each ending with EOS, cut into windows):

* ``train-rope-causal`` / ``train-rope-document``: the 1.1B Llama shape (TinyLlama: d 2048, 22 layers, 32 heads,
  4 K/V heads), SDPA causal (FlashAttention) against compiled flex_attention with a per-batch document-causal
  ``BlockMask`` and RoPE positions restarting at each document;
* ``train-alibi-causal`` / ``train-alibi-document``: MPT-1B's shape (ALiBi), flex_attention with the causal block
  mask against the document-causal one (same ``score_mod``).

Each row gives seconds per step, tokens/s, MFU (anytrain's ``flops_per_token``, equal with and without the mask: the
convention counts the full causal square; a document mask skips more of it), peak memory and the mean documents per
sequence; document rows also time building one micro-batch's ``BlockMask`` alone (``mask_build_ms``, part of every
micro-step).

Results: a table on stdout and ``--out/packing_<device>.json`` (``packing_smoke.json`` with ``--smoke``, whose rows
run in this process on the CPU, where the masks are explicit SDPA masks: a check that the bench runs, not a
measurement).

    PYTHONPATH=src python -m bench.packing --out bench/results          # GPU: the full table (~6 minutes)
    PYTHONPATH=src python -m bench.packing --smoke --out /tmp/packing   # CPU check: debug shapes, 2 steps, no compile
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from anytrain import hardware
from anytrain.config import ModelConfig, RunConfig
from anytrain.models import layers
from anytrain.train.trainer import Trainer
from bench.common import bench_device, print_row, release, row_error, run_row_in_child, save_rows, timed

ROWS = ["train-rope-causal", "train-rope-document", "train-alibi-causal", "train-alibi-document"]
EOS_ID = 0


def shape(pos: str, smoke: bool) -> dict:
    if smoke:
        flavour = "mpt-debug" if pos == "alibi" else "debug"
        return {"flavour": flavour, "vocab": 512, "seq": 64, "micro": 2, "global_batch": 4}
    flavour, vocab = ("mpt-1b", 50368) if pos == "alibi" else ("1.1b", 32000)
    return {"flavour": flavour, "vocab": vocab, "seq": 2048, "micro": 4, "global_batch": 8}


class PackedBatches:
    """A bank of global batches of packed random documents: lengths geometric with mean ``doc_len`` tokens (the last
    one EOS), concatenated and cut into rows of ``seq + 1`` tokens. ``rank_batch`` has the trainer's BatchSource
    signature; ``eos_id`` is what ``data.document_mask`` splits at."""

    eos_id = EOS_ID

    def __init__(self, vocab: int, global_batch: int, seq: int, doc_len: int, seed: int = 0, bank: int = 4) -> None:
        rng = np.random.default_rng(seed)
        need = bank * global_batch * (seq + 1)
        lengths = rng.geometric(1.0 / doc_len, size=need // doc_len * 4 + 16)
        ends = np.cumsum(lengths)
        ends = ends[: int(np.searchsorted(ends, need)) + 1]
        stream = rng.integers(EOS_ID + 1, vocab, size=int(ends[-1]), dtype=np.int64)
        stream[ends - 1] = EOS_ID
        self.bank = list(torch.from_numpy(stream[:need]).view(bank, global_batch, seq + 1))

    def rank_batch(self, step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = self.bank[step % len(self.bank)]  # (G, T+1)
        per_rank = tokens.shape[0] // world
        tokens = tokens[rank * per_rank : (rank + 1) * per_rank]
        return tokens[:, :-1], tokens[:, 1:], torch.arange(tokens.shape[0])

    def documents_per_sequence(self) -> float:
        """Mean number of documents (whole or cut) a sequence holds."""
        inputs = torch.cat([b[:, :-1] for b in self.bank])
        return float((layers.document_ids(inputs, EOS_ID)[0][:, -1] + 1).float().mean())


def mask_build_ms(batches: PackedBatches, micro: int, device: torch.device, repeats: int = 10) -> float:
    """Milliseconds to build one micro-batch's document mask as the model does (BlockMask on GPUs, explicit on CPU)."""
    inputs = batches.rank_batch(0)[0][:micro].to(device)
    build = layers.document_block_mask if hardware.is_gpu(device) else layers.document_causal_mask

    def once() -> None:
        build(layers.document_ids(inputs, EOS_ID)[0])

    once()
    hardware.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        once()
    hardware.synchronize(device)
    return 1e3 * (time.perf_counter() - started) / repeats


def train_row(pos: str, document: bool, device: torch.device, args: argparse.Namespace) -> dict:
    s = shape(pos, args.smoke)
    cfg = RunConfig()
    cfg.model = ModelConfig(arch="transformer", flavour=s["flavour"], args={"pos_encoding": pos})
    cfg.device = "cpu" if args.smoke else "auto"
    cfg.data.seq_len, cfg.data.document_mask = s["seq"], document
    cfg.train.global_batch, cfg.train.micro_batch = s["global_batch"], s["micro"]
    cfg.train.compile, cfg.train.dtype = not args.smoke, "fp32" if args.smoke else "bf16"
    cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps = 2e-4, 100, 1000
    batches = PackedBatches(s["vocab"], s["global_batch"], s["seq"], args.doc_len)
    trainer = Trainer(cfg, batches=batches)
    row = {**s, "doc_len_mean": args.doc_len, "documents_per_sequence": batches.documents_per_sequence()}
    row.update(timed(trainer.train_step, device, args.warmup, args.steps))
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
    if document:
        row["mask_build_ms"] = mask_build_ms(batches, s["micro"], device)
    return row


def run_row(name: str, args: argparse.Namespace) -> dict:
    device = bench_device(args.smoke)
    release(device)
    _, pos, mask = name.split("-")
    row = {"row": name, "pos_encoding": pos, "document_mask": mask == "document"}
    try:
        row.update(train_row(pos, mask == "document", device, args))
    except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
        row["error"] = row_error(exc)
    return row


def run_child(name: str, args: argparse.Namespace) -> dict:
    argv = ["--out", args.out, "--steps", str(args.steps), "--warmup", str(args.warmup), "--doc-len", str(args.doc_len)]
    return run_row_in_child("bench.packing", argv, name)


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'row':<22}{'ms/step':>10}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'docs/seq':>10}{'mask ms':>9}"
        f"{'vs causal':>11}"
    )
    base = {r["pos_encoding"]: r["seconds_per_step"] for r in rows if not r.get("document_mask") and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['row']:<22}  {r['error'][:90]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        mask = f"{r['mask_build_ms']:.2f}" if "mask_build_ms" in r else ""
        pos = r["pos_encoding"]
        ratio = f"{r['seconds_per_step'] / base[pos]:.3f}x" if pos in base else ""
        print(
            f"{r['row']:<22}{1e3 * r['seconds_per_step']:>10.1f}{r['tokens_per_s']:>12,.0f}{mfu:>8}"
            f"{r['peak_mem_gib']:>10.1f}{r['documents_per_sequence']:>10.1f}{mask:>9}{ratio:>11}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results", help="directory for packing_<device>.json")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--doc-len", type=int, default=512, help="mean document length in tokens (geometric)")
    parser.add_argument("--rows", nargs="*", default=ROWS, choices=ROWS)
    parser.add_argument("--smoke", action="store_true", help="CPU check: debug shapes, 2 steps, no compile, in-process")
    parser.add_argument("--one-row", default=None, help=argparse.SUPPRESS)  # a child: run this row, print it
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.doc_len = 2, 1, min(args.doc_len, 16)
    if args.one_row:
        print_row(run_row(args.one_row, args))
        return
    rows = [run_row(name, args) if args.smoke else run_child(name, args) for name in args.rows]
    print_table(rows)
    save_rows("packing", args.out, rows, args.smoke)


if __name__ == "__main__":
    main()
