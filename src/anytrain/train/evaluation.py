"""Validation loss of the model being trained: over the validation split or each data source, pipeline forward, eval
log records."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from anytrain.config import TrainConfig
from anytrain.data.loader import BatchProvider
from anytrain.parallel.collectives import all_reduce_mean

if TYPE_CHECKING:
    from anytrain.train.build import BuiltModel, DataSources, Layout
    from anytrain.train.metrics import MetricsLogger


class Evaluator:
    """The mean next-token loss of ``built``'s model over the first ``train.eval_batches`` global batches of the
    validation split (each rank its data-parallel slice); with data.sources, each source's and their weighted mean."""

    def __init__(
        self, cfg: TrainConfig, layout: Layout, built: BuiltModel, sources: DataSources, log: MetricsLogger
    ) -> None:
        self.cfg, self.layout, self.built, self.sources, self.log = cfg, layout, built, sources, log
        self.by_source: dict[str, float] = {}  # data.sources: each source's loss at the last evaluation

    @property
    def batches(self) -> int:
        """Validation batches per evaluation: none without a validation split (a trainer fed ``batches``)."""
        return self.cfg.eval_batches if self.sources.val is not None else 0

    def evaluate(self) -> float:
        """The validation loss; with data.sources, the weighted mean of each source's (kept in ``by_source``)."""
        if self.sources.val_by_name is None:
            return self._evaluate_split(self.sources.val)
        self.by_source = {name: self._evaluate_split(source) for name, source in self.sources.val_by_name.items()}
        weights = self.sources.train.weights
        return float(sum(w * loss for w, loss in zip(weights, self.by_source.values(), strict=True)))

    def evaluate_and_log(self, step: int) -> float:
        """``evaluate`` and its record (``kind: eval``) after ``step`` steps."""
        val = self.evaluate()
        per_source = {f"val_loss/{name}": loss for name, loss in self.by_source.items()}
        self.log.log({"step": step, "val_loss": val, "val_ppl": math.exp(min(val, 50.0)), **per_source}, kind="eval")
        return val

    @torch.no_grad()
    def _evaluate_split(self, val_source: BatchProvider) -> float:
        built, layout = self.built, self.layout
        model, pipeline, device = built.model, built.pipeline, layout.device
        model.eval()
        total = torch.zeros(2, device=device, dtype=torch.float64)  # (loss sum, token count)
        micro = layout.plan.micro_batch
        for batch in range(self.cfg.eval_batches):
            inputs, targets, _ = val_source.rank_batch(batch, layout.dp_rank, layout.dp_world)
            for i in range(0, inputs.shape[0], micro):
                x, y = inputs[i : i + micro].to(device), targets[i : i + micro].to(device)
                with built.autocast():
                    if pipeline is None:
                        logits = model(x)
                    else:
                        logits = pipeline.forward_only(x, built.accounting_model.hidden_size)
                if logits is None:  # a pipeline rank without the last stage
                    continue
                total[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").double()
                total[1] += (y != -100).sum()  # targets of -100 (prompt tokens of SFT data) are not scored
        model.train()
        for part in built.parts:
            for module in part.modules():  # no backward follows: free what FSDP kept gathered (root, last block)
                if isinstance(module, FSDPModule):
                    module.reshard()
        total = all_reduce_mean(total)
        return (total[0] / total[1]).item() if total[1] > 0 else float("nan")
