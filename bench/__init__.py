"""attnrnn benchmarks: one registry of shapes, ops timed side by side with baselines, JSON out."""
