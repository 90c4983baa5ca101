"""`keras.distribution` on the TensorFlow backend.

Keras 3's distribution API (`DeviceMesh`, `LayoutMap`, `DataParallel`,
`ModelParallel`) only acts on the JAX and PyTorch backends; on TensorFlow
Keras records the distribution and leaves every weight on one device.
Once tfpar is imported, `keras.distribution.set_distribution(d)` (and
`with d.scope():`) makes tfpar's strategy for `d` TensorFlow's default
strategy (`tf.distribute.experimental_set_strategy`), so ordinary Keras
code that follows, with no tfpar scope and no callbacks, trains laid out
as `d` says; `set_distribution(None)` sets no strategy again.
`from_keras_distribution` gives the same strategy for use in its own
scope:

- `DataParallel` becomes `tfpar.DataParallelStrategy` over its devices;
- for `ModelParallel`, the mesh axis it splits the batch on
  (`batch_dim_name`) becomes tfpar's `data` axis, its other axis tfpar's
  `tensor` axis (`tfpar.TensorParallelStrategy`);
- a `LayoutMap` entry that splits a weight over the model axis makes tfpar
  split that weight over `tensor`, along the dimension its Megatron-style
  plan computes with (attention by heads, MLPs column- then row-parallel,
  embeddings by vocabulary); a weight the entry does not split over the
  model axis, or that no entry matches, stays whole (Keras's rule);
- an entry that names the batch axis (keras-hub's layout maps shard
  weights over both, as FSDP does) means "spread this weight over the data
  replicas too": tfpar does that with ZeRO stage 3, in the strategy itself
  (`DataParallelStrategy(zero=tfpar.ZeRO(stage=3))` with a model axis of
  size 1, `TensorParallelStrategy(..., zero=tfpar.ZeRO(stage=3))` with
  both), so the strategy is complete alone and `set_distribution` needs no
  callbacks.
- an entry for a layer's output (`<layer path>/output`, which Keras's JAX
  backend uses to relayout activations) is left out with a warning: tfpar
  lays out activations itself (Keras's TensorFlow backend has no relayout
  and failed with an AttributeError there).
"""

import collections
import weakref

import keras
import tensorflow as tf

from tfpar._compat import keras_distribution_parts
from tfpar._compat.keras_modules import distribution_lib

KerasDistributionSetup = collections.namedtuple(
    "KerasDistributionSetup", ["strategy", "callbacks"])


def from_keras_distribution(distribution):
  """The tfpar strategy that carries out a Keras distribution.

  Args:
    distribution: a `keras.distribution.DataParallel` or
      `keras.distribution.ModelParallel` (its `DeviceMesh` with the batch
      axis and at most one other axis).

  Returns:
    A `KerasDistributionSetup`: `strategy, callbacks = ...`. Create and
    compile the model in `strategy.scope()` (or call
    `keras.distribution.set_distribution(distribution)` instead, which
    makes this strategy the default). `callbacks` is empty: a layout map
    that spreads weights over the batch axis gives a strategy that applies
    ZeRO-3 itself (its `zero=` option). It stays in the result for code
    written when it carried `tfpar.ZeRO` for `fit`.

  Raises:
    ValueError: another kind of distribution, a mesh with more than two
      axes, or a mesh whose devices are not this host's. A layout tfpar
      cannot carry out is a ValueError naming the variable when the model
      is built.

  Example:

  >>> import keras, tfpar
  >>> devices = tfpar.configure_virtual_cpus(4)
  >>> mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
  >>> layout_map = keras.distribution.LayoutMap(mesh)
  >>> layout_map["up/kernel"] = (None, "model")
  >>> layout_map["down/kernel"] = ("model", None)
  >>> strategy, callbacks = tfpar.from_keras_distribution(
  ...     keras.distribution.ModelParallel(layout_map=layout_map,
  ...                                      batch_dim_name="batch"))
  >>> print(strategy.mesh.shape, callbacks)
  {'data': 2, 'pipeline': 1, 'tensor': 2} []
  """
  # Imported here: tfpar's Keras hooks import this module, and the
  # strategies import those hooks.
  from tfpar import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from tfpar.data_parallel import strategy as data_strategy  # pylint: disable=g-import-not-at-top
  from tfpar.tensor_parallel import layout_map as layout_map_lib  # pylint: disable=g-import-not-at-top
  from tfpar.tensor_parallel import strategy as tensor_strategy  # pylint: disable=g-import-not-at-top
  from tfpar.zero import callback as zero_callback  # pylint: disable=g-import-not-at-top
  if isinstance(distribution, distribution_lib.DataParallel):
    devices = _tensorflow_devices(distribution.device_mesh.devices.ravel())
    return KerasDistributionSetup(data_strategy.DataParallelStrategy(
        mesh_lib.Mesh({"data": len(devices)}, devices)), [])
  if not isinstance(distribution, distribution_lib.ModelParallel):
    raise ValueError(
        f"from_keras_distribution takes keras.distribution.DataParallel or "
        f"ModelParallel. Received: {distribution!r}")
  device_mesh = distribution.device_mesh
  names = list(device_mesh.axis_names)
  batch = distribution.batch_dim_name
  others = [name for name in names if name != batch]
  if len(names) > 2 or len(others) != 1:
    raise ValueError(
        f"from_keras_distribution maps a DeviceMesh with the batch axis "
        f"{batch!r} and one model axis onto tfpar's data x tensor mesh. "
        f"Received: axis_names={names}, shape={device_mesh.shape}")
  model_axis = others[0]
  sizes = dict(zip(names, device_mesh.shape))
  data, tensor = sizes.get(batch, 1), sizes[model_axis]
  # tfpar's meshes are data-major: put the batch axis first.
  grid = device_mesh.devices
  if names[0] != batch and len(names) == 2:
    grid = grid.T
  devices = _tensorflow_devices(grid.ravel())
  layout_map = keras_distribution_parts.layout_map(distribution)
  spreads_over_batch = data > 1 and any(
      layout is not None and batch in tuple(layout.axes) and
      not key.endswith(_OUTPUT) for key, layout in layout_map.items())
  if tensor == 1 and spreads_over_batch:
    return KerasDistributionSetup(data_strategy.DataParallelStrategy(
        mesh_lib.Mesh({"data": data}, devices),
        zero=zero_callback.ZeRO(stage=3)), [])
  strategy = tensor_strategy.TensorParallelStrategy(
      mesh_lib.Mesh({"data": data, "tensor": tensor}, devices),
      plan=layout_map_lib.LayoutMapPlan(layout_map, model_axis),
      zero=zero_callback.ZeRO(stage=3) if spreads_over_batch else None)
  return KerasDistributionSetup(strategy, [])


# How Keras names a layer's output in a layout map (`Layer.__call__`).
_OUTPUT = "/output"


def _tensorflow_devices(names):
  """This host's TensorFlow device names for Keras's ("cpu:0", "gpu:1")."""
  from tfpar import local_devices  # pylint: disable=g-import-not-at-top
  _, local = local_devices.local_accelerators()
  by_kind = {}
  for name in local:
    spec = tf.DeviceSpec.from_string(name)
    by_kind[(spec.device_type.upper(), spec.device_index)] = name
  found = []
  for name in names:
    spec = tf.DeviceSpec.from_string(str(name))
    device = by_kind.get(((spec.device_type or "").upper(),
                          spec.device_index))
    if device is None:
      raise ValueError(
          f"The keras.distribution DeviceMesh names device {str(name)!r}, "
          f"which is not one of this host's devices {list(local)}. "
          f"Received: devices={[str(n) for n in names]}")
    found.append(device)
  return tuple(found)


# The strategy made for each distribution set (the same one each time it
# is set again, as `Distribution.scope()` does when it exits a nested one)
# and the strategy tfpar made TensorFlow's default, if any.
_strategies = weakref.WeakKeyDictionary()
_default = [None]


def set_distribution(value):
  """`keras.distribution.set_distribution` once tfpar is imported.

  On the TensorFlow backend, sets `value`'s tfpar strategy (see
  `from_keras_distribution`) as TensorFlow's default strategy, so that
  models created afterwards are laid out and trained as `value` says with
  no strategy scope; `None` sets no strategy again. Keras records `value`
  as it always does: `keras.distribution.distribution()` returns it.
  `with value.scope():` calls this on entry and exit.

  Args:
    value: a `keras.distribution.DataParallel` or `ModelParallel`, or
      None.

  Raises:
    ValueError: a distribution `from_keras_distribution` does not take, or
      a call inside a `tf.distribute` strategy's scope (the default
      strategy cannot change there).

  Example:

  >>> import keras, numpy as np, tfpar
  >>> devices = tfpar.configure_virtual_cpus(4)
  >>> keras.distribution.set_distribution(keras.distribution.DataParallel())
  >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  >>> model.compile(optimizer="sgd", loss="mse")
  >>> history = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
  >>> model.distribute_strategy.num_replicas_in_sync
  4
  >>> keras.distribution.set_distribution(None)
  >>> keras.distribution.distribution() is None
  True
  """
  original = _keras_set_distribution[0]
  if keras.backend.backend() != "tensorflow":
    return original(value)
  strategy = None
  if value is not None:
    strategy = _strategies.get(value)
    if strategy is None:
      strategy, _ = from_keras_distribution(value)
      _strategies[value] = strategy
  if tf.distribute.has_strategy() and (
      tf.distribute.get_strategy() is not _default[0]):
    raise ValueError(
        f"keras.distribution.set_distribution({type(value).__name__}) "
        f"makes its strategy TensorFlow's default, which cannot change "
        f"inside the scope of strategy {tf.distribute.get_strategy()!r}. "
        f"Call it outside any strategy scope.")
  if strategy is not _default[0]:
    tf.distribute.experimental_set_strategy(strategy)
    _default[0] = strategy
  return original(value)


_keras_set_distribution = [None]


def install_set_distribution():
  """Makes `keras.distribution.set_distribution` (and
  `Distribution.scope()`) set tfpar's strategy on TensorFlow."""
  current = keras_distribution_parts.set_distribution_function()
  if current is set_distribution:
    return
  _keras_set_distribution[0] = current
  keras_distribution_parts.install_output_layouts()
  keras_distribution_parts.replace_set_distribution(set_distribution)
