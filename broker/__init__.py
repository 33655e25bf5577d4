"""broker: a cost-aware cloud GPU broker for multi-node PyTorch DDP jobs.

Plans the cheapest valid topology for a job within a dollar budget, provisions it, runs the recipe with
``torchrun`` on every node, and tears everything down on a hard deadline.  See README.md.
"""

__version__ = "0.1.0"
