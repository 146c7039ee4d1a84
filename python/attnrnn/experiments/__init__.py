"""Experiments built on attnrnn's models; each runs as ``python -m attnrnn.experiments.<name>``.

``power_of_two``: computing 2^x with and without a chain of thought, softmax against linear
attention, by model size (the memory-bottleneck experiment).
"""
