"""Run ``torchtitan.train`` (torchtitan 0.3.0) on a released torch: the entry point that
``bench/torchtitan_trainer.py`` hands to torchrun in place of ``-m torchtitan.train``.

torchtitan 0.3.0 follows torch nightly; on torch 2.11 (the GPU hosts) and 2.13 some things
it uses do not exist. Each is added only where missing, and nothing else is changed:

* ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12): imported at module
  scope by ``torchtitan.distributed.fsdp`` / ``full_dtensor``; only *used* by the
  ``full_dtensor`` / ``spmd_types`` SPMD backends, which the benchmark does not select
  (it passes ``--parallelism.spmd_backend partial_dtensor``: plain FSDP2 over the dp mesh).
  The placeholder raises if it is ever constructed.
* ``torch.distributed.set_timeout(timeout, group)`` (not in torch 2.13 either): called by
  ``Trainer.train`` after the first step (``dist_utils.set_pg_timeouts``); implemented
  with ``torch.distributed.distributed_c10d._set_pg_timeout``, which is what it does.
* ``create_block_mask(..., separate_full_blocks=True)`` (the keyword is torch >= 2.12): the
  llama3 decoder passes it through ``torchtitan.models.common.attention.create_attention_mask``;
  torch 2.11's ``create_block_mask`` always separates full blocks, so the keyword is dropped
  when it is ``True`` (an error if ``False``, batch-invariant mode) by wrapping that module's
  ``_compiled_create_block_mask``.

Then ``torchtitan.train.main()`` runs unchanged, with the command line it was given.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

PATCHED: list[str] = []


def apply() -> list[str]:
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        class DataParallelMeshDims:  # noqa: N801 - the name torchtitan imports
            def __init__(self, *args, **kwargs):
                raise RuntimeError("DataParallelMeshDims needs torch >= 2.12; run torchtitan with "
                                   "--parallelism.spmd_backend partial_dtensor")

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        PATCHED.append("torch.distributed.fsdp.DataParallelMeshDims (placeholder)")
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        def set_timeout(timeout, group=None):
            _set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout
        PATCHED.append("torch.distributed.set_timeout (= distributed_c10d._set_pg_timeout)")
    return PATCHED


def apply_after_import() -> list[str]:
    """Patches that need torchtitan imported."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        import torchtitan.models.common.attention as attention

        compiled = attention._compiled_create_block_mask

        def create_block_mask_compat(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:  # batch-invariant mode: not what torch 2.11 does
                raise RuntimeError("separate_full_blocks=False needs torch >= 2.12")
            return compiled(*args, **kwargs)

        attention._compiled_create_block_mask = create_block_mask_compat
        PATCHED.append("torchtitan create_attention_mask: separate_full_blocks=True dropped "
                       "(torch < 2.12 create_block_mask always separates full blocks)")
    return PATCHED


def main() -> None:
    apply()
    apply_after_import()
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    logger.info("torchtitan_launch: torch %s; added where missing: %s", torch.__version__,
                "; ".join(PATCHED) or "nothing")
    from torchtitan.train import main as train_main

    sys.argv[0] = "torchtitan.train"
    train_main()


if __name__ == "__main__":
    main()
