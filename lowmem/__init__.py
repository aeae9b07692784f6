"""lowmem: train neural networks in a fraction of the usual memory.

Four composable techniques (``lowmem.techniques``): dynamic sparse reparameterization,
pure low precision, true/simulated microbatching and residual-block activation checkpointing,
met in one trainer (``lowmem.trainer``) and measured by one profiler (``lowmem.profile``).
Any model, in a loop of the user's own: ``lowmem.prepare`` and ``lowmem.plan`` (``lowmem.api``).
"""

from lowmem.api import Run, plan, prepare

__all__ = ["Run", "plan", "prepare"]
__version__ = "0.1.0"
