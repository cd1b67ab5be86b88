"""The end-to-end comparisons' measures (measures.py) on hand-made logits (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from measures import NEAR_TIE_SIGMAS, gap_sigmas, greedy_agreement, row_cosines  # noqa: E402


def _logits(steps: int, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(steps, vocab, generator=torch.Generator().manual_seed(0))


def test_identical_choices_agree_everywhere():
    rows = _logits(4)
    tokens = rows.argmax(dim=-1).tolist()
    assert greedy_agreement(tokens, rows, tokens) == (1.0, [])


def test_a_near_tie_counts_as_equal_and_is_reported():
    rows = _logits(4)
    tokens = rows.argmax(dim=-1).tolist()
    sigma = float(rows[1].std())
    rows[1, 7] = rows[1, tokens[1]] - 0.5 * NEAR_TIE_SIGMAS * sigma
    got = list(tokens)
    got[1] = 7
    share, differing = greedy_agreement(got, rows, tokens)
    assert share == 1.0
    assert len(differing) == 1 and differing[0].startswith("step 1: 0.02")


def test_a_clear_loser_counts_against_the_share():
    rows = _logits(4)
    tokens = rows.argmax(dim=-1).tolist()
    got = list(tokens)
    got[2] = int(rows[2].argmin())
    share, differing = greedy_agreement(got, rows, tokens)
    assert share == 0.75
    assert len(differing) == 1 and differing[0].startswith("step 2: ")
    assert float(differing[0].split()[2]) > 2


def test_row_cosines():
    rows = _logits(3)
    assert torch.allclose(row_cosines(rows, 2 * rows), torch.ones(3))
    assert torch.allclose(row_cosines(rows, -rows), -torch.ones(3))


def test_gap_sigmas_is_the_lead_in_row_deviations():
    row = torch.tensor([0.0, 1.0, 3.0, 3.0])
    sigma = float(row.std())
    assert gap_sigmas(row, 2, 3) == 0.0
    assert gap_sigmas(row, 2, 1) == pytest.approx(2.0 / sigma)
    assert gap_sigmas(row, 1, 2) == pytest.approx(-2.0 / sigma)
