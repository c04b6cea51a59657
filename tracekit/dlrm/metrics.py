"""Click-prediction metrics: ROC AUC (ties get their average rank) and log loss."""

from __future__ import annotations

import torch


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    scores, labels = scores.double().flatten(), labels.double().flatten()
    positives = float(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = torch.argsort(scores)
    _, counts = torch.unique_consecutive(scores[order], return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average_rank = (ends - (counts.double() - 1) / 2).repeat_interleave(counts)  # 1-based
    rank_sum = float((average_rank * labels[order]).sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))
