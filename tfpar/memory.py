"""`memory_report`: bytes of parameters and optimizer state per device."""

import collections
import dataclasses
from typing import Dict

from tfpar._compat import keras_layers
from tfpar._compat import keras_weights_view
from tfpar._compat.tf_modules import values_lib
from tfpar.engine import spread


def components(variable):
  """The per-device tf.Variables behind a Keras (or tf) variable.

  Args:
    variable: a Keras variable or a tf.Variable, distributed or not.

  Example:

  >>> import keras
  >>> from tfpar.memory import components
  >>> len(components(keras.Variable([1.0, 2.0])))
  1
  """
  value = keras_layers.storage(variable, variable)
  if isinstance(value, values_lib.DistributedValues):
    return value.values
  if isinstance(value, spread.SpreadVariable):  # Not laid out yet.
    return value.components()
  return (value,)


def _nbytes(component):
  return int(component.shape.num_elements()) * component.dtype.size


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Bytes each device holds for a model.

  Attributes:
    parameters: {device: bytes of model variables}.
    optimizer: {device: bytes of optimizer variables (slots, step count)}.
  """
  parameters: Dict[str, int]
  optimizer: Dict[str, int]

  @property
  def devices(self):
    return sorted(set(self.parameters) | set(self.optimizer))

  def total(self, device):
    """Parameter plus optimizer bytes on `device`."""
    return self.parameters.get(device, 0) + self.optimizer.get(device, 0)

  def __str__(self):
    lines = [f"{'device':<40} {'parameters':>12} {'optimizer':>12}"]
    for device in self.devices:
      lines.append(f"{device:<40} {self.parameters.get(device, 0):>12,} "
                   f"{self.optimizer.get(device, 0):>12,}")
    return "\n".join(lines)


def memory_report(model):
  """Bytes of parameters and optimizer slots on every device.

  Counts each device's own copy: a replicated weight counts on the head of
  every replica, shard k of a split weight on the k-th device of every
  replica. Optimizer state counts once its optimizer is built.

  Args:
    model: a Keras model (with or without a strategy).

  Returns:
    A `MemoryReport`.

  Example:

  >>> import keras, tfpar
  >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  >>> sum(tfpar.memory_report(model).parameters.values())
  40
  """
  parameters = collections.Counter()
  # The variables held (tensor shards), not `model.weights`' whole views.
  for variable in keras_weights_view.held_weights(model):
    for component in components(variable):
      parameters[component.device] += _nbytes(component)
  optimizer = collections.Counter()
  model_optimizer = getattr(model, "optimizer", None)
  if model_optimizer is not None and model_optimizer.built:
    for variable in model_optimizer.variables:
      for component in components(variable):
        optimizer[component.device] += _nbytes(component)
  return MemoryReport(dict(parameters), dict(optimizer))
