"""`keras.distribution` layouts on the TensorFlow backend.

Keras 3's distribution API (`DeviceMesh`, `LayoutMap`, `DataParallel`,
`ModelParallel`) only acts on the JAX and PyTorch backends; on TensorFlow
Keras records the distribution and leaves every weight on one device.
`from_keras_distribution` turns such a distribution into tfpar's strategy:

- the mesh axis `ModelParallel` splits the batch on (`batch_dim_name`)
  becomes tfpar's `data` axis, its other axis tfpar's `tensor` axis;
- a `LayoutMap` entry that splits a weight over the model axis makes tfpar
  split that weight over `tensor`, along the dimension its Megatron-style
  plan computes with (attention by heads, MLPs column- then row-parallel,
  embeddings by vocabulary); a weight the entry does not split over the
  model axis, or that no entry matches, stays whole (Keras's rule);
- an entry that also names the batch axis (keras-hub's layout maps shard
  weights over both, as FSDP does) means "spread this weight over the data
  replicas too": tfpar does that with ZeRO stage 3, returned as a callback.

Importing tfpar also makes `keras.distribution.set_distribution(...)` (and
`with distribution.scope():`) on the TensorFlow backend raise a ValueError
pointing here, instead of silently training on one device.
"""

import collections

import keras

from tfpar._compat import keras_distribution_parts
from tfpar._compat.keras_modules import distribution_lib

KerasDistributionSetup = collections.namedtuple(
    "KerasDistributionSetup", ["strategy", "callbacks"])


def from_keras_distribution(distribution):
  """The tfpar strategy (and callbacks) that carry out a Keras distribution.

  Args:
    distribution: a `keras.distribution.DataParallel` or
      `keras.distribution.ModelParallel` (its `DeviceMesh` with the batch
      axis and at most one other axis).

  Returns:
    A `KerasDistributionSetup`: `strategy, callbacks = ...`. Create and
    compile the model in `strategy.scope()` and pass `callbacks` to `fit`
    (`[tfpar.ZeRO(stage=3)]` when the layout map also spreads weights over
    the batch axis, else empty).

  Raises:
    ValueError: another kind of distribution, a mesh with more than two
      axes, or a mesh that does not fit this host's devices. A layout tfpar
      cannot carry out is a ValueError naming the variable when the model is
      built.

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
  >>> print(strategy.mesh.shape)
  {'data': 2, 'pipeline': 1, 'tensor': 2}
  """
  # Imported here: tfpar's Keras hooks import this module for
  # `install_refusal`, and the strategies import those hooks.
  from tfpar import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from tfpar.data_parallel import strategy as data_strategy  # pylint: disable=g-import-not-at-top
  from tfpar.tensor_parallel import layout_map as layout_map_lib  # pylint: disable=g-import-not-at-top
  from tfpar.tensor_parallel import strategy as tensor_strategy  # pylint: disable=g-import-not-at-top
  from tfpar.zero import callback as zero_callback  # pylint: disable=g-import-not-at-top
  if isinstance(distribution, distribution_lib.DataParallel):
    size = distribution.device_mesh.shape[0]
    return KerasDistributionSetup(
        data_strategy.DataParallelStrategy(mesh_lib.Mesh({"data": size})), [])
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
  sizes = dict(zip(names, device_mesh.shape))
  model_axis = others[0]
  layout_map = keras_distribution_parts.layout_map(distribution)
  strategy = tensor_strategy.TensorParallelStrategy(
      mesh_lib.Mesh({"data": sizes.get(batch, 1),
                     "tensor": sizes[model_axis]}),
      plan=layout_map_lib.LayoutMapPlan(layout_map, model_axis))
  spreads_over_batch = any(
      layout is not None and batch in tuple(layout.axes)
      for layout in layout_map.values())
  callbacks = ([zero_callback.ZeRO(stage=3)]
               if spreads_over_batch and sizes.get(batch, 1) > 1 else [])
  return KerasDistributionSetup(strategy, callbacks)


def _refuse_on_tensorflow(original):
  def set_distribution(value):
    if value is not None and keras.backend.backend() == "tensorflow":
      raise ValueError(
          f"keras.distribution.set_distribution({type(value).__name__}) "
          f"does nothing on the TensorFlow backend: Keras would train on "
          f"one device. Use strategy, callbacks = "
          f"tfpar.from_keras_distribution(distribution), create the model "
          f"in strategy.scope() and pass the callbacks to fit.")
    return original(value)
  set_distribution.__doc__ = original.__doc__
  set_distribution.tfpar_refuses = True
  return set_distribution


def install_refusal():
  """Makes `keras.distribution.set_distribution` (and `Distribution.scope`)
  raise on the TensorFlow backend instead of doing nothing."""
  if getattr(distribution_lib.set_distribution, "tfpar_refuses", False):
    return
  refusing = _refuse_on_tensorflow(distribution_lib.set_distribution)
  distribution_lib.set_distribution = refusing
  keras.distribution.set_distribution = refusing
