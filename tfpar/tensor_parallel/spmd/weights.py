"""Split weights under SPMD: one variable per weight, a shard per device.

Under SPMD every device of a tensor group runs the same trace, so a split
weight is ONE Keras variable whose storage is a mirrored variable over all
`data x tensor` devices: the component on the k-th device of every replica
holds shard k. Each trace reads its own component (its local shard), the
optimizer updates each component with that component's gradients, and
Keras's trainer and optimizer see an ordinary variable of the shard's
shape. `SpmdWeight` is its whole view (`model.weights`, `get_weights`,
saving), read and written column by column through `ColumnPiece`s.
"""

import contextlib
import threading

import keras
import numpy as np
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar.common import optimizer_checkpoint
from tfpar.common.split_weights import LogicalTensor
from tfpar.common.split_weights import ShardedWeight
from tfpar.common.split_weights import install_logical_saving
from tfpar.common.split_weights import record_logical_weight
from tfpar.engine import whole_state
from tfpar.tensor_parallel import variables as variables_lib
from tfpar.tensor_parallel.spmd import terms


class ColumnPiece:
  """Shard `column` of a variable held on every device: the components on
  the `column`-th device of every replica (kept equal by training).

  Args:
    variable: a Keras variable whose storage is mirrored over the data x
      tensor devices, replica-major.
    column: the index within the tensor group.
    tensor_size: devices per tensor group.
  """

  def __init__(self, variable, column, tensor_size):
    self._variable = variable
    self._column = column
    self._tensor_size = tensor_size
    self.path = f"{variable.path}_column{column}"

  def _components(self):
    values = keras_layers.storage(self._variable).values
    return values[self._column::self._tensor_size]

  shape = property(lambda self: tuple(self._variable.shape))
  dtype = property(lambda self: self._variable.dtype)
  trainable = property(lambda self: self._variable.trainable)

  @property
  def value(self):
    """The shard as held by the first replica."""
    if hasattr(self._variable, "_tfpar_column_numpy"):
      return tf.constant(self.numpy())
    return tf.convert_to_tensor(self._components()[0])

  def numpy(self):
    """The shard, as a NumPy array."""
    # Sliced by tfpar.ZeRO(stage=3) over the column: it joins the slices.
    column_numpy = getattr(self._variable, "_tfpar_column_numpy", None)
    if column_numpy is not None:
      return column_numpy(self._column)
    return self._components()[0].numpy()

  def assign(self, value):
    """Sets the shard on every replica."""
    assign_column = getattr(self._variable, "_tfpar_assign_column", None)
    if assign_column is not None:
      assign_column(self._column, value)
      return
    for component in self._components():
      component.assign(value)


class SpmdWeight(ShardedWeight):
  """The whole view of a weight split under SPMD.

  Args:
    layout: its `VariableLayout`.
    variable: the Keras variable holding shard k on the k-th device of
      every replica.
    tensor_size: devices per tensor group.
  """

  def __init__(self, layout, variable, tensor_size):
    super().__init__(layout, [ColumnPiece(variable, k, tensor_size)
                              for k in range(tensor_size)])
    self.variable = variable
    variable._tfpar_shard_of = (self, 0)  # pylint: disable=protected-access

  @property
  def trainable(self):
    return self.variable.trainable

  @trainable.setter
  def trainable(self, value):  # Keras's enable_lora freezes the kernel.
    self.variable.trainable = value


def split_layer(layer_layout, tensor_size, strategy, groups=None):
  """Replaces each split variable of a layer by one SPMD variable.

  Args:
    layer_layout: the layer's `LayerLayout`.
    tensor_size: devices per tensor group.
    strategy: the strategy (its scope creates the new variables over
      every data x tensor device).
    groups: the `collectives.TensorGroups` the layer computes over
      (default the strategy's `tensor_groups`; a pipeline stage's).

  Returns:
    The `SpmdWeight`s created.
  """
  owners = variables_lib.owners_of(layer_layout.layer)
  created = []
  for variable_layout in layer_layout.variables:
    if variable_layout.axis is None:
      continue
    owner, variable = owners[variable_layout.path]
    pieces = np.split(np.asarray(variable.numpy()), tensor_size,
                      variable_layout.axis)
    variables_lib.release_spread(variable)  # Its creation-time slices.
    with strategy.scope():
      local = keras.Variable(
          pieces[0], dtype=variable.dtype,
          trainable=keras_layers.storage_trainable(variable),
          name=variable.name)
    local.trainable = variable.trainable
    for index, component in enumerate(keras_layers.storage(local).values):
      component.assign(pieces[index % tensor_size], read_value=False)
    keras_layers.set_path(local, variable.path)
    weight = SpmdWeight(variable_layout, local, tensor_size)
    terms.carry_over(variable, weight,
                     groups or strategy.extended.tensor_groups)
    _replace(owner, variable, local, weight)
    created.append(weight)
  for owner in {owners[w.path][0] for w in created}:
    install_logical_saving(owner)
  return created


def _replace(owner, variable, local, weight):
  """Puts `local` where `variable` was in `owner`'s variable lists and
  attributes, and `weight` in its logical order (saving)."""
  record_logical_weight(owner, variable, weight)
  for store in keras_layers.variable_lists(owner):
    for position, item in enumerate(store):
      if item is variable:
        store[position] = local
        break
  attributes = vars(owner).setdefault("_tfpar_split_attributes", {})
  for attribute, value in list(vars(owner).items()):
    if value is variable:
      attributes[attribute] = weight
      object.__setattr__(owner, attribute, local)
      # tf.train.Checkpoint follows tracked attributes: save the whole
      # weight where the variable was (the local one would save shard 0).
      keras_layers.track(owner, weight, attribute)
      # Inside `whole_attributes`: whole until its outermost entry exits.
      frame = next((f for f in _viewing.frames if id(owner) in f[0]), None)
      if frame is not None:
        frame[1].append((owner, attribute, local))
        object.__setattr__(owner, attribute, weight)


class _Viewing(threading.local):
  frames = ()  # (ids of layers, [(layer, attribute, local)]), outermost first


_viewing = _Viewing()


@contextlib.contextmanager
def whole_attributes(layers):
  """Eagerly, each split weight's attribute of `layers` (a layer's
  `_kernel`, `lora_kernel_a`...) is its whole `SpmdWeight` inside (in a
  step each device reads its shard there): Keras's and keras-hub's own
  code that reads and assigns whole values through those attributes
  (`save_own_variables`, `save_lora_weights`, `enable_lora`) works
  unchanged. Weights split inside are seen whole too."""
  previous = _viewing.frames
  swapped = []
  _viewing.frames = previous + (({id(layer) for layer in layers}, swapped),)
  try:
    for layer in layers:
      for attribute, weight in getattr(layer, "_tfpar_split_attributes",
                                       {}).items():
        swapped.append((layer, attribute, vars(layer)[attribute]))
        object.__setattr__(layer, attribute, weight)
    yield
  finally:
    for layer, attribute, local in reversed(swapped):
      object.__setattr__(layer, attribute, local)
    _viewing.frames = previous


def spmd_weights(model):
  """{path: SpmdWeight} of a model sharded under SPMD."""
  found = {}
  for layer in keras_layers.flatten_layers(model, include_self=True):
    for item in getattr(layer, "_tfpar_logical_order", ()):
      if isinstance(item, SpmdWeight):
        found[item.path] = item
  return found


def whole_entries(items, model, slots=None):
  """`items` (an optimizer's variables, or the model variables it tracks)
  as an unsharded model's optimizer has them: a split weight whole (its
  `SpmdWeight`), its slots whole (`LogicalTensor`s over their columns).

  Args:
    items: a list of variables.
    model: the sharded model.
    slots: memoizes the whole slots (by slot variable), so lists sharing
      a slot share its `LogicalTensor`.

  Returns:
    The list, whole.
  """
  slots = {} if slots is None else slots
  weights = spmd_weights(model)
  prefixes = {w.path.replace("/", "_") + "_": w for w in weights.values()}
  entries = []
  for item in items:
    shard_of = getattr(item, "_tfpar_shard_of", None)
    if isinstance(shard_of, tuple) and isinstance(shard_of[0], SpmdWeight):
      entries.append(shard_of[0])
      continue
    name = getattr(item, "name", "")
    weight = next((w for p, w in prefixes.items() if name.startswith(p) and
                   tuple(item.shape) == tuple(w.variable.shape)), None)
    if weight is None:
      entries.append(item)
      continue
    if id(item) not in slots:
      t = len(weight.shards)
      slots[id(item)] = LogicalTensor(
          [ColumnPiece(item, k, t) for k in range(t)], weight.axis)
    entries.append(slots[id(item)])
  return entries


def optimizer_entries(optimizer, model):
  """`optimizer.variables` as an unsharded model's optimizer has them
  (`whole_entries`)."""
  return whole_entries(optimizer.variables, model)


def adopt_optimizer(optimizer, model):
  """Makes `optimizer` save and load whole slots (any layout loads them),
  in Keras files and `tf.train.Checkpoint`s."""
  if getattr(optimizer, "_tfpar_adopted", False):
    return
  whole_state.save_whole_state(optimizer,
                               lambda: optimizer_entries(optimizer, model))
  optimizer_checkpoint.install(
      optimizer, lambda: len(spmd_weights(model)),
      lambda items, slots: whole_entries(items, model, slots))
  object.__setattr__(optimizer, "_tfpar_adopted", True)
