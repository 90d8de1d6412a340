"""purerl: reinforcement learning for language models as a functional trainer on PyTorch.

State is data (frozen attrs pytrees, :mod:`purerl.tree`), the algorithm maths is pure functions
(:mod:`purerl.algo`), and effects (generation, sharded updates, weight sync, IO) sit behind a
small interface. Import submodules directly; this package keeps imports light.
"""

__version__ = "0.1.0"
