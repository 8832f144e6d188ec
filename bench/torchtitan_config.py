"""The job config of ``bench/torchtitan_trainer.py``: torchtitan's registered
``llama3_debugmodel`` (``torchtitan.models.llama3.config_registry``), selected with
``--module torchtitan_config --config llama3_debugmodel_bench`` (this folder is on the
path of ``bench/torchtitan_launch.py``). Everything else the benchmark sets is on the
command line (see ``trainer_args`` there); the checkpoint backend is chosen there too,
by ``--override.imports zarrckpt.interop.torchtitan.use_zarrckpt`` or not at all (DCP).

One change, on torch < 2.12 only (the GPU hosts have 2.11): the loss is torchtitan's
``CrossEntropyLoss`` on the whole logits instead of ``ChunkedLossWrapper`` around it. The
wrapper computes ``lm_head`` + loss per chunk with a backward per chunk and then calls
``lm_head.reshard()``; the debug model puts ``norm`` and ``lm_head`` in one FSDP group, so
on torch 2.11 that reshard frees the unsharded ``norm`` weight that autograd saved, and the
backward through ``norm`` fails ("The tensor has a non-zero number of elements, but its
data is not allocated yet"; reproduced on 2 CPU ranks with torch 2.11.0, not with 2.13).
The loss is the same function of the same logits; only its memory schedule differs.
"""

from __future__ import annotations

import torch
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.tools.logging import logger


def _torch_at_least(major: int, minor: int) -> bool:
    v = torch.__version__.split("+")[0].split(".")
    return (int(v[0]), int(v[1])) >= (major, minor)


def llama3_debugmodel_bench():
    config = llama3_debugmodel()
    if not _torch_at_least(2, 12) and isinstance(config.loss, ChunkedLossWrapper.Config):
        config.loss = config.loss.loss_fn
        logger.info("torchtitan_config: torch %s < 2.12: loss %s without ChunkedLossWrapper",
                    torch.__version__, type(config.loss).__qualname__)
    return config
