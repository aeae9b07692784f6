"""Planning under a memory budget.

- ``schedule``: checkpoint placement by dynamic programming over a chain of residual blocks;
- ``measure``: the per-block figures it reasons with, measured on fake tensors;
- ``optimal``: ``checkpointing.strategy=optimal``, the cheapest placement whose real accounting
  fits ``checkpointing.budget_mb``;
- ``search`` and ``reported``: ``python -m lowmem.plan``'s search over density, precision, optimizer
  state bits, microbatch and checkpointing, and the report's accuracy figures for its table.

The profiler never imports this package; the trainer imports ``optimal`` only.
"""
