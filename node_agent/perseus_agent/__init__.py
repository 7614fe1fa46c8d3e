"""Perseus node agent: applies per-GPU frequency plans, measures energy, exports metrics."""
