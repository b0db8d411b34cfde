"""The Trainer's evaluation: validation loss over the split or each data source, pipeline forward, eval log records."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from anytrain.data.loader import BatchSource
from anytrain.parallel.collectives import all_reduce_mean
from anytrain.parallel.pipeline import pipeline_forward


class Evaluation:
    """The Trainer's validation-loss methods (mixed into Trainer: they read its model, layout and sources)."""

    def evaluate(self) -> float:
        """Mean next-token loss over the first ``eval_batches`` global batches of the validation split; with
        data.sources, the weighted mean of each source's (those are kept in ``self.val_by_source``)."""
        if self.val_sources is None:
            return self._evaluate_split(self.val_source)
        self.val_by_source = {name: self._evaluate_split(source) for name, source in self.val_sources.items()}
        weights = self.train_source.weights
        return float(sum(w * loss for w, loss in zip(weights, self.val_by_source.values(), strict=True)))

    @torch.no_grad()
    def _evaluate_split(self, val_source: BatchSource) -> float:
        self.model.eval()
        total = torch.zeros(2, device=self.device, dtype=torch.float64)  # (loss sum, token count)
        micro = self.plan.micro_batch
        for batch in range(self.cfg.train.eval_batches):
            inputs, targets, _ = val_source.rank_batch(batch, self.dp_rank, self.dp_world)
            for i in range(0, inputs.shape[0], micro):
                x, y = inputs[i : i + micro].to(self.device), targets[i : i + micro].to(self.device)
                with self._autocast():
                    logits = self.model(x) if self.pp_schedule is None else self._pipeline_logits(x)
                if logits is None:  # a pipeline rank without the last stage
                    continue
                total[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").double()
                total[1] += (y != -100).sum()  # targets of -100 (prompt tokens of SFT data) are not scored
        self.model.train()
        for part in self.pp_parts if self.pp_schedule is not None else [self.model]:
            for module in part.modules():  # no backward follows: free what FSDP kept gathered (root, last block)
                if isinstance(module, FSDPModule):
                    module.reshard()
        total = all_reduce_mean(total)
        return (total[0] / total[1]).item() if total[1] > 0 else float("nan")

    def _pipeline_logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Forward-only pass of one micro-batch through the pipeline, stage after stage; logits on the last stage."""
        width = getattr(self.model_args, "dim", None) or self.model_args.d_model
        return pipeline_forward(self.pp_parts, self.pp_stages, self.pp_n_stages, self.pp_group, self.pp_rank,
                                self.dims.pp, tokens, (*tokens.shape, width))  # fmt: skip

    def _eval_batches(self) -> int:
        """Validation batches per evaluation: none without a validation split (a trainer fed ``batches``)."""
        return self.cfg.train.eval_batches if self.val_source is not None else 0

    def _eval_and_log(self, step: int) -> float:
        val = self.evaluate()
        per_source = {f"val_loss/{name}": loss for name, loss in getattr(self, "val_by_source", {}).items()}
        self.log.log({"step": step, "val_loss": val, "val_ppl": math.exp(min(val, 50.0)), **per_source}, kind="eval")
        return val
