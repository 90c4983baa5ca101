"""`TensorStagesExtended`: tensor-parallel pipeline stages (3D),
`PipelineParallelStrategy` on a mesh with a tensor axis.

A replica's step is traced once per tensor column k: the thread of column
k runs the whole schedule on the k-th device of every stage (stage s on
device `s x tensor + k` of the replica), each stage's split layers
computing their shard and communicating by collectives of the stage's
tensor group (`tensor_parallel/spmd/`), its replicated work done by every
device of the group. An activation goes from stage s to stage s + 1 on the
same column, so the threads never wait for each other: only their
collectives meet, in the schedule's order, which every thread traces
alike.

Variables: every variable of stage s has one component on each device of
the stage's tensor group in every replica (replica-major); a split
weight's component on the k-th holds shard k (`spmd/weights.py`), a
replicated weight is the same on all. Each thread's replica id selects
the components of its column (`DeviceReplicaId`), whatever the stage.
Gradients are all-reduced over the data replicas within each device
column of each stage (`engine/per_device/reductions.py`, by the column of the
devices). Variables outside the stages (metrics, the optimizer's step
counter) live on stage 0's devices.
"""

import numpy as np

from tfpar.common import whole_weights
from tfpar.engine import spread
from tfpar.engine import variable_placement
from tfpar.engine.per_device import checks as per_device_checks
from tfpar.engine.per_device import collectives
from tfpar.engine.per_device import extended as per_device_extended
from tfpar.pipeline import executor
from tfpar.pipeline import extended as extended_lib
from tfpar.pipeline import placement
from tfpar.pipeline import stage_generation
from tfpar.tensor_parallel import structure
from tfpar.tensor_parallel import styles as tp_styles
from tfpar.tensor_parallel.spmd import adapters
from tfpar.tensor_parallel.spmd import checks
from tfpar.tensor_parallel.spmd import dropout as dropout_lib
from tfpar.tensor_parallel.spmd import generation
from tfpar.tensor_parallel.spmd import layers as layers_lib
from tfpar.tensor_parallel.spmd import memo as memo_lib
from tfpar.tensor_parallel.spmd import optimizer as optimizer_lib
from tfpar.tensor_parallel.spmd import terms
from tfpar.tensor_parallel.spmd import weights as weights_lib


class TensorStagesExtended(per_device_extended.PerDeviceExtended,
                           extended_lib.PipelineParallelExtended):
  """The logic of `tfpar.PipelineParallelStrategy` with a tensor axis
  (arguments as `PipelineParallelExtended`'s)."""


  def __init__(self, container_strategy, mesh, num_microbatches, schedule,
               stages, recompute, virtual_stages, plan,
               communication_options=None, float32_sums=False):
    per_device_checks.check_strategy(mesh)
    super().__init__(container_strategy, mesh, num_microbatches, schedule,
                     stages, recompute, virtual_stages, plan,
                     communication_options, float32_sums)
    t = self.tensor_size
    # Per pipeline device d: the tensor groups of its stages, one per
    # replica, and the layers' per-trace memory of those stages.
    self._stage_groups = []
    for d in range(self.pipeline_size):
      columns = slice(d * t, (d + 1) * t)
      self._stage_groups.append(collectives.TensorGroups(
          [group[columns] for group in self._local_groups],
          self._collective_keys, self._communication_options,
          [tuple(group[columns]) for group in mesh.replicas]))
    self._memos = [memo_lib.Memo(groups, False, float32_sums)
                   for groups in self._stage_groups]
    # The traces start on stage 0's devices; the optimizer's tensor-group
    # sums (loss-scale overflow, clipping norms, shared key/value heads)
    # go through stage 0's groups too.
    self._groups = self._stage_groups[0]
    self._first_replica = mesh.replicas.index(self._local_groups[0])
    self._paired = ()
    self._pairs = {}
    self._sequence_parallel = False
    self.partial_weights = _AllPartial(self._memos)

  def _clear_memos(self):
    for memo in self._memos:
      memo.clear()

  def _create_variable(self, next_creator, **kwargs):
    placed = self.placed_by_caller(kwargs)
    # Model weights outside a trace are created spread over the replicas'
    # devices (and moved to their stages when the model is cut).
    spreading = (spread.should_spread(kwargs) and
                 collectives.current_slot() is None)
    if not placed and not spreading:
      kwargs["colocate_with"] = variable_placement.DeviceSet(
          self._groups.devices)
    return super()._create_variable(next_creator, **kwargs)

  def stage_variable_devices(self, column):
    """Every device of the stage's tensor group in every replica."""
    t = self.tensor_size
    return tuple(group[column + k] for group in self._local_groups
                 for k in range(t))

  def prepare_optimizer(self, optimizer, model):
    """Once `model` is cut, makes `optimizer` work on the stages' shards
    (whole-slot checkpoints, clipping by whole weights)."""
    if self.is_prepared(model):
      self._adopt(optimizer, model)

  def tensor_layouts(self, model):
    with structure.shared_trace(model):  # One trace for the plan and pairs.
      layer_layouts = self.plan.resolve(model, self.tensor_size)
      self._check_layouts(model, layer_layouts)
    return layer_layouts

  def _shard_stages(self, model, plan, layer_layouts):
    """Splits each stage's layers over the stage's tensor groups."""
    stage_of = plan.stage_of_layers()
    by_stage = {stage.index: [l for l in layer_layouts
                              if stage_of.get(id(l.layer)) == stage.index]
                for stage in plan.stages}
    shard = self._stage_layout_sharder(stage_of)
    # Interleaved over the stages: split weights created spread over every
    # device leave each about as fast as its shards arrive (engine/spread).
    layout_bytes = lambda l: sum(np.prod(v.shape) for v in l.variables)
    for index, layout in placement.interleaved(by_stage, layout_bytes):
      shard(index, layout)
    for stage in plan.stages:
      dropout_lib.install(stage.model, by_stage[stage.index],
                          self._memos[stage.index % self.pipeline_size])
    object.__setattr__(model, "_tfpar_layouts", layer_layouts)
    whole_weights.install(model)
    adapters.install(model, self._container_strategy(), self.tensor_size,
                     placing=self._stage_placing(stage_of))
    # The stage models are Models of their own over the same layers: their
    # `trainable_weights` (read for regularization losses) must list the
    # shards too, not their layers' whole weights.
    for stage in plan.stages:
      whole_weights.install(stage.model)
    if getattr(model, "optimizer", None) is not None:
      self._adopt(model.optimizer, model)

  def _check_layouts(self, model, layer_layouts):
    checks.check_model(model, False)
    checks.check_layouts(layer_layouts, False, model)
    # Read before cutting: the stages' sub-models add nodes to the layers,
    # which hides the column -> row pairs.
    self._paired = layers_lib.paired_layers(model, layer_layouts)
    self._pairs = _pairs(model, [layout.layer for layout in layer_layouts
                                 if layout.layer in self._paired])
    terms.check(layer_layouts, self._paired, False)

  def _stage_placing(self, stage_of):
    """`placing(layer)` for LoRA enabled after the cut: the tensor groups
    of the layer's stage, and its stage's devices to create variables on."""
    def placing(layer):
      index = stage_of.get(id(layer), 0)
      column = placement.stage_column(index, self.pipeline_size,
                                      self.tensor_size)
      return (self._stage_groups[index % self.pipeline_size],
              self.variables_on_devices(self.stage_variable_devices(column)))
    return placing

  def _stage_layout_sharder(self, stage_of):
    """`shard(stage index, layout)`: one layer split SPMD over its stage's
    tensor groups."""
    # A column -> row pair cut between stages exchanges whole activations
    # (the stage models' inputs are whole): its column layers gather their
    # outputs, its row layer slices its input, and so do the other pairs
    # sharing those column layers (a residual stream of split outputs).
    unpaired, changed = set(), True
    while changed:
      changed = False
      for row, columns in self._pairs.items():
        crossing = any(stage_of.get(id(c)) != stage_of.get(id(row))
                       for c in columns)
        if row not in unpaired and (crossing or unpaired & columns):
          unpaired |= {row, *columns}
          changed = True
    paired = set(self._paired) - unpaired
    strategy = self._container_strategy()

    def shard(index, layout):
      column = placement.stage_column(index, self.pipeline_size,
                                      self.tensor_size)
      device = index % self.pipeline_size
      with spread.creating_in_place(), self.variables_on_devices(
          self.stage_variable_devices(column)):
        weights_lib.split_layer(layout, self.tensor_size, strategy,
                                self._stage_groups[device])
      layers_lib.install(layout, self._memos[device], paired)
      object.__setattr__(layout.layer, "_tfpar_layer_layout", layout)
    return shard

  def generate_function(self, model):
    """keras-hub's `generate` run per tensor column as under tensor
    parallelism, each stage's layers on their stage's devices
    (`stage_generation.py`); the key/value cache split by heads."""
    return generation.generate_function(
        self, model, placing=stage_generation.layers_on_stage_devices)

  def _adopt(self, optimizer, model):
    optimizer_lib.adopt(optimizer, model, self._groups,
                        self.partial_weights)

  def runner(self, plan):
    """The `StageRunner` of the running trace: its column of every
    stage."""
    slot = collectives.current_slot()
    column = 0 if slot is None else slot.tensor_index
    group = self.current_group()
    return executor.StageRunner(
        [stage.model for stage in plan.stages],
        [group[placement.stage_column(stage.index, self.pipeline_size,
                                      self.tensor_size) + column]
         for stage in plan.stages],
        self.schedule, self.recompute, self.virtual_stages)


def _pairs(model, paired):
  """{row-parallel layer: the column-parallel layers feeding it} of the
  `paired` layers of `model`, in the plan's order (the order
  `paired_layers` matched them in; each row layer is then traced with the
  column layers alone)."""
  found = structure.mlp_styles(model, paired)
  columns = [l for l in paired
             if isinstance(found.get(l), tp_styles.ColumnParallel)]
  pairs = {}
  for row in paired:
    if isinstance(found.get(row), tp_styles.RowParallel):
      alone = structure.mlp_styles(model, [row] + columns)
      pairs[row] = {l for l in columns
                    if isinstance(alone.get(l), tp_styles.ColumnParallel)}
  return pairs


class _AllPartial:
  """The stages' memos' weights with partial gradients, as one mapping
  (read when a step is traced)."""

  def __init__(self, memos):
    self._memos = memos

  def __contains__(self, key):
    return any(key in memo.partial_weights for memo in self._memos)

  def __len__(self):
    return sum(len(memo.partial_weights) for memo in self._memos)
