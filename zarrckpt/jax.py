"""``zarrckpt.jax``: load checkpoints into sharded ``jax.Array``s and save them back
(needs jax, not torch). See :mod:`zarrckpt.interop.jax`.

>>> import zarrckpt.jax                                                   # doctest: +SKIP
>>> params = zarrckpt.jax.load("ckpt/step_100", NamedSharding(mesh, P()), keys=["model"])  # doctest: +SKIP
>>> zarrckpt.jax.save({"model": params["model"], "step": 100}, "ckpt/jax_100")          # doctest: +SKIP
"""

from .interop.jax import load, save

__all__ = ["load", "save"]
