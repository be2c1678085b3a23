"""Evaluation harness: run task samples through a model with a strategy, score them, and report.

- `harness`: batched generation with per-example failure accounting, scores and token counts;
- `fidelity`: label-free metrics on long text (teacher-forced KL / top-1 agreement vs dense, attention mass the
  selected keys recover vs the oracle Top-k);
- `report`: aggregate rows with confidence intervals, CSV / JSON / Markdown / PNG.
"""
