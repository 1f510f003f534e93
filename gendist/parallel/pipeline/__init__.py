"""Pipeline parallelism: schedules as tables, one executor (`core`), the engines built on it.

    table      the schedule table: which action each stage runs at each step
    schedules  named schedules (GPipe, 1F1B, interleaved, ZB-H1, PipeDream) as tables
    plan       where each device keeps and receives the microbatches a table holds
    stats      a table's bubble, time and pictures (and `plan`'s lines)
    partition  layers to stages: min-max dynamic programming over profiled costs
    core       the scan over a schedule table (the only one), buffers, final reduction
    stages     a model as stage functions; what a forward / backward step computes
    sync       GPipe, 1F1B and any validated table: loss and gradients
    pipedream  PipeDream (weight stashing, no stashing) and PipeDream-2BW: asynchronous
               updates inside the pipeline, weight versions as an extra carry and a hook
    terapipe   TeraPipe: token slices of each sequence, a K/V cache as an extra carry
    model      gendist's transformer on these engines (specs, per-device ops)
"""

from gendist.parallel.pipeline.core import PIPELINE, stage_layer_split
from gendist.parallel.pipeline.sync import pipeline_loss_and_grads, sequential_loss

__all__ = ["PIPELINE", "pipeline_loss_and_grads", "sequential_loss", "stage_layer_split"]
