"""How the end-to-end tests compare a specialized engine's records with stock's (pure torch,
so they are tested on the CPU: test_measures.py)."""

from __future__ import annotations

import torch

# Greedy steps where the two choices are tied in stock's own logits count as equal. With
# N(0, 0.02) weights the logits are a Gaussian cloud over 163840 tokens: the top two are on
# average ~0.2 sigma apart and often far closer, so bf16 noise flips some argmaxes. Measured
# on the H200 (2026-12-01): even the auto engine, stock code in another process, picked
# another token than stock at 1 of 64 steps (logits cosine 0.999995); the specialized engine
# (cosine >= 0.99997, i.e. ~0.8% relative noise) at 0-3% of the steps. A tie is a gap under
# 0.05 sigma of the row, ~5x the noise such a cosine leaves between two logits; a wrong
# token from a real fault (lost state, wrong expert) comes with logits that move the
# cosine far below its threshold (and its gap is no tie).
NEAR_TIE_SIGMAS = 0.05


def row_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-30)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def row_rel_errs(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    got, ref = got.float(), ref.float()
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)


def gap_sigmas(row: torch.Tensor, ref_token: int, got_token: int) -> float:
    """How far ``got_token`` trails ``ref_token`` in one row of logits, in the row's standard
    deviations (below NEAR_TIE_SIGMAS: a tie)."""
    row = row.float()
    return float((row[ref_token] - row[got_token]) / row.std().clamp_min(1e-30))


def greedy_agreement(
    got_argmax: list[int], stock_logits: torch.Tensor, stock_tokens: list[int]
) -> tuple[float, list[str]]:
    """Share of steps whose greedy choice equals stock's, a step counting as equal when the
    two tokens are tied within NEAR_TIE_SIGMAS in stock's logits; and a description of each
    step that differs (its gap in sigmas)."""
    equal, differing = 0, []
    for step, (got, ref) in enumerate(zip(got_argmax, stock_tokens)):
        gap = gap_sigmas(stock_logits[step], ref, got)
        if got == ref or gap < NEAR_TIE_SIGMAS:
            equal += 1
        if got != ref:
            differing.append(f"step {step}: {gap:.4f} sigma")
    return equal / len(stock_tokens), differing
