"""The scaling study's cases (bench/scaling.py): what each row runs (model, GPUs, layout, batch, options) and the
trainer options of a layout.

Case names: ``<model>-<layout>-<GPUs>-g<global batch>``; ``t-`` the 1.1B Transformer, ``m-`` Mamba-1.4b, ``hf-ddp-``
transformers' LlamaForCausalLM under DDP, ``v-`` the cost-model validation's small recipes, ``p-`` profiled rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RECIPES = {"transformer": "configs/1.1b.yaml", "mamba": "configs/mamba-1.4b.yaml"}
LEGACY_DDP_BUCKET_MB = 25.0
"""DDP's bucket size of rows recorded before the rows carried ``ddp_bucket_mb`` (PyTorch's default, used until then)."""
MODEL_NAMES = {"transformer": "llama-1.1b", "mamba": "mamba-1.4b"}


@dataclass
class Case:
    name: str
    model: str  # "transformer" | "mamba"
    gpus: int
    layout: str  # "single" | "fsdp" | "zero2" | "zero1" | "hsdp" | "ddp" | "tp" | "pp" | "hf-ddp"
    global_batch: int
    micro: int = 4
    seq: int = 2048
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    studies: tuple[str, ...] = ()  # "weak", "strong", "layout"
    extra: list[str] = field(default_factory=list)
    recipe: str = ""  # default: RECIPES[model]

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def accum(self) -> int:
        return self.global_batch // (self.dp * self.micro)


def default_cases(max_gpus: int) -> list[Case]:
    """Priority order (a time budget drops the tail): the 1- and 2-GPU study of issue #6 for both models, the
    cost-model validation's small runs, then 4 GPUs (issue #8)."""
    t, m = "transformer", "mamba"
    gathered = ["--parallel.reshard_during_accumulation", "false"]
    group2, group4 = (["--parallel.fsdp_group_blocks", str(k)] for k in (2, 4))
    profiled = ["--profile.start_step", "4", "--profile.steps", "1"]
    async_tp = ["--parallel.async_tp", "true"]
    interleaved = ["--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_virtual_stages", "2"]
    graphs = ["--train.cuda_graphs", "true"]
    cases = [
        Case("t-1-g32", t, 1, "single", 32, studies=("strong",)),
        Case("t-1-g8", t, 1, "single", 8, studies=("weak",)),
        Case("v-tiny-1", t, 1, "single", 16, micro=16, seq=256, recipe="configs/tiny.yaml", studies=("cost",)),
        Case("v-125m-1", t, 1, "single", 64, micro=16, seq=1024, recipe="configs/125m.yaml", studies=("cost",)),
        Case("t-fsdp-2-g32", t, 2, "fsdp", 32, studies=("strong", "layout")),
        Case("t-fsdp-2-g16", t, 2, "fsdp", 16, studies=("weak",)),
        # FSDP keeping the gathered parameters through the accumulation micro-batches; ZeRO-2's weak scaling; one
        # profiled FSDP step per rank (studies=(): the profiled step's overhead must not enter an efficiency)
        Case("t-fsdpg-2-g32", t, 2, "fsdp", 32, studies=("strong",), extra=gathered),
        Case("t-fsdpg-2-g16", t, 2, "fsdp", 16, studies=("weak",), extra=gathered),
        Case("t-zero2-2-g16", t, 2, "zero2", 16, studies=("weak",)),
        Case("p-fsdp-2-g16", t, 2, "fsdp", 16, extra=profiled),
        Case("p-1-g8", t, 1, "single", 8, extra=profiled),
        Case("hf-ddp-1-g8", t, 1, "hf-ddp", 8, studies=("weak",)),
        Case("hf-ddp-2-g16", t, 2, "hf-ddp", 16, studies=("weak",)),
        Case("t-ddp-2-g32", t, 2, "ddp", 32, studies=("strong", "layout")),
        Case("t-tp2-2-g32", t, 2, "tp", 32, tp=2, studies=("layout",)),
        Case("t-pp2-2-g32", t, 2, "pp", 32, pp=2, studies=("layout",)),
        Case("m-1-g32", m, 1, "single", 32, studies=("strong",)),
        Case("m-1-g8", m, 1, "single", 8, studies=("weak",)),
        Case("m-fsdp-2-g32", m, 2, "fsdp", 32, studies=("strong", "layout")),
        Case("m-fsdp-2-g16", m, 2, "fsdp", 16, studies=("weak",)),
        Case("m-fsdpg-2-g32", m, 2, "fsdp", 32, studies=("strong",), extra=gathered),
        Case("m-fsdpg-2-g16", m, 2, "fsdp", 16, studies=("weak",), extra=gathered),
        # gathered FSDP with 4 Mamba blocks (2 Transformer blocks) per FSDP unit: fewer, larger collectives and fewer
        # per-unit hooks (parallel.fsdp_group_blocks)
        Case("m-fsdpgg-2-g32", m, 2, "fsdp", 32, studies=("strong",), extra=gathered + group4),
        Case("m-fsdpgg-2-g16", m, 2, "fsdp", 16, studies=("weak",), extra=gathered + group4),
        Case("t-fsdpgg-2-g16", t, 2, "fsdp", 16, studies=("weak",), extra=gathered + group2),
        # one profiled step per rank of Mamba's weak-scaling pair (gathered FSDP on 2 GPUs, the 1-GPU reference)
        Case("pm-fsdpg-2-g16", m, 2, "fsdp", 16, extra=gathered + profiled),
        Case("pm-1-g8", m, 1, "single", 8, extra=profiled),
        Case("m-ddp-2-g32", m, 2, "ddp", 32, studies=("layout",)),
        Case("m-pp2-2-g32", m, 2, "pp", 32, pp=2, studies=("layout",), extra=["--model.args.tie_embeddings", "false"]),
        Case("t-zero2-2-g32", t, 2, "zero2", 32, studies=("layout",)),
        Case("t-zero1-2-g32", t, 2, "zero1", 32, studies=("layout",)),
        # 4 GPUs (issue #8), the recommended layouts first: gathered FSDP for both models, then the plain layouts
        Case("t-fsdpg-4-g32", t, 4, "fsdp", 32, studies=("strong", "weak"), extra=gathered),
        Case("m-fsdpg-4-g32", m, 4, "fsdp", 32, studies=("strong", "weak"), extra=gathered),
        Case("t-fsdp-4-g32", t, 4, "fsdp", 32, studies=("strong", "weak", "layout")),
        Case("t-zero2-4-g32", t, 4, "zero2", 32, studies=("strong", "layout")),
        Case("hf-ddp-4-g32", t, 4, "hf-ddp", 32, studies=("weak",)),
        Case("t-hsdp2x2-4-g32", t, 4, "hsdp", 32, dp_replicate=2, studies=("layout",)),
        Case("t-tp4-4-g32", t, 4, "tp", 32, tp=4, studies=("layout",)),
        Case("t-pp4-4-g32", t, 4, "pp", 32, pp=4, studies=("layout",)),
        Case("m-fsdp-4-g32", m, 4, "fsdp", 32, studies=("strong", "weak", "layout")),
        Case("t-tp2-fsdp2-4-g32", t, 4, "tp", 32, tp=2, studies=("layout",)),
        Case("t-zero1-4-g32", t, 4, "zero1", 32, studies=("strong", "layout")),
        Case("t-ddp-4-g32", t, 4, "ddp", 32, studies=("strong", "layout")),
        Case("m-ddp-4-g32", m, 4, "ddp", 32, studies=("strong", "layout")),
        Case("m-pp4-4-g32", m, 4, "pp", 32, pp=4, studies=("layout",), extra=["--model.args.tie_embeddings", "false"]),
        # tensor parallelism with a micro-batch of 16 (TP divides the activations, so the larger micro-batch fits:
        # 4x fewer, 4x larger collectives and host launches per token), and with async TP on top; the interleaved
        # pipeline schedule; the 2D layouts
        Case("t-tp4mb16-4-g32", t, 4, "tp", 32, micro=16, tp=4, studies=("layout",)),
        Case("t-tp4async-4-g32", t, 4, "tp", 32, micro=16, tp=4, studies=("layout",), extra=async_tp),
        Case("t-tp2mb16-2-g32", t, 2, "tp", 32, micro=16, tp=2, studies=("layout",)),
        Case("t-tp2async-2-g32", t, 2, "tp", 32, micro=16, tp=2, studies=("layout",), extra=async_tp),
        # TP's host work replayed from CUDA graphs (tensor parallelism alone is captured, collectives included)
        Case("t-tp4graphs-4-g32", t, 4, "tp", 32, micro=16, tp=4, studies=("layout",), extra=graphs),
        Case("t-tp4mb4graphs-4-g32", t, 4, "tp", 32, tp=4, studies=("layout",), extra=graphs),
        Case("t-tp2graphs-2-g32", t, 2, "tp", 32, micro=16, tp=2, studies=("layout",), extra=graphs),
        Case("t-pp4i-4-g32", t, 4, "pp", 32, pp=4, studies=("layout",), extra=interleaved),
        Case("t-pp2-fsdp2-4-g32", t, 4, "pp", 32, pp=2, studies=("layout",)),
        Case("t-tp2-pp2-4-g32", t, 4, "pp", 32, tp=2, pp=2, studies=("layout",)),
        Case("t-tp2async-fsdp2-4-g32", t, 4, "tp", 32, micro=16, tp=2, studies=("layout",), extra=async_tp),
        # 8 GPUs (issue #8; needs an 8-GPU host): the goal row (FSDP strong at the recipe's global batch of 32, one
        # micro-batch per GPU), the weak rows at 8 sequences per GPU (global 64, vs t-1-g8 / m-1-g8 / hf-ddp-1-g8),
        # the plain layouts and HSDP 2x4
        Case("t-fsdp-8-g32", t, 8, "fsdp", 32, studies=("strong", "layout")),
        Case("t-fsdpg-8-g64", t, 8, "fsdp", 64, studies=("weak",), extra=gathered),
        Case("hf-ddp-8-g64", t, 8, "hf-ddp", 64, studies=("weak",)),
        Case("t-ddp-8-g32", t, 8, "ddp", 32, studies=("strong", "layout")),
        Case("t-zero1-8-g32", t, 8, "zero1", 32, studies=("strong", "layout")),
        Case("t-hsdp2x4-8-g32", t, 8, "hsdp", 32, dp_replicate=2, studies=("strong", "layout")),
        Case("m-ddp-8-g32", m, 8, "ddp", 32, studies=("strong", "layout")),
        Case("m-fsdpg-8-g64", m, 8, "fsdp", 64, studies=("weak",), extra=gathered),
        Case("m-fsdp-8-g32", m, 8, "fsdp", 32, studies=("strong", "layout")),
    ]
    return [c for c in cases if c.gpus <= max_gpus]


def layout_overrides(layout: str, tp: int, pp: int, dp_replicate: int) -> list[str]:
    """The trainer options that make a row's layout (``Case.layout`` and its degrees)."""
    strategy = {
        "single": "auto",
        "fsdp": "fsdp",
        "hsdp": "fsdp",
        "ddp": "ddp",
        "tp": "fsdp",
        "pp": "fsdp",
        "zero2": "fsdp",
        "zero1": "zero1",
    }[layout]
    args = [
        "--parallel.strategy",
        strategy,
        "--parallel.tp",
        str(tp),
        "--parallel.pp",
        str(pp),
        "--parallel.dp_replicate",
        str(dp_replicate),
    ]
    if layout == "zero2":  # FSDP keeping the gathered parameters from forward to backward
        args += ["--parallel.reshard_after_forward", "false"]
    return args
