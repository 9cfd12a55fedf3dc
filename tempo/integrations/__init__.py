"""Tempo for models users already have: apply_tempo/revert_tempo, the HF attention registration."""
