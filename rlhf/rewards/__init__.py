"""Rule-based reward functions."""
