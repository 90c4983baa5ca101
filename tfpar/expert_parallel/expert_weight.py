"""`ExpertWeight`: the whole [num_experts, ...] view of an expert weight
split over the expert group (and the tensor columns under expert x
tensor: then each device's component holds its own slot).

It is what `model.weights` / `layer.weights` list in place of the local
expert variables (`tfpar.common.whole_weights`), so it reads, converts and
assigns as one device's variable does: `numpy()`, `np.asarray`,
`tf.convert_to_tensor`, `value`, `assign`, `shape`, `dtype`, `name`, `path`,
`trainable`, `regularizer`, `constraint`. It is also a checkpoint object:
`tf.train.Checkpoint` saves it as the whole tensor and restores each local
component's experts from one.
"""

import numpy as np
import tensorflow as tf

from tfpar._compat.tf_modules import trackable_base
from tfpar.common.split_weights import VARIABLE_VALUE
from tfpar.common.split_weights import WholeWeightView
from tfpar.memory import components


class ExpertWeight(WholeWeightView, trackable_base.Trackable):
  """The whole [num_experts, ...] view of an expert weight split over the
  expert group.

  Args:
    path: the original weight's path.
    variable: the Keras variable of the local experts.
    ranks: the slot each of its components holds (the expert rank of a
      local replica; under expert x tensor `rank x tensor + k` on the k-th
      device of the replica).
    expert: the number of slots (the expert-group size; x tensor under
      expert x tensor).

  The experts are split into `expert` equal slots: the component holding
  slot j holds experts `j*E/expert ... (j+1)*E/expert - 1`. When some
  slots live on other workers (an expert group
  spanning workers), `numpy()` gathers the whole weight from every worker
  (a collective: every worker must read the same weights in the same
  order); `value`, `tf.convert_to_tensor` and checkpoints refuse with a
  `ValueError`.

  Example:

  >>> import keras
  >>> weight = ExpertWeight("moe/w", keras.Variable(np.ones((2, 3))), [0], 1)
  >>> weight.numpy().shape, weight.shape, weight.name
  ((2, 3), (2, 3), 'w')
  >>> weight.assign(np.zeros((2, 3)))
  >>> float(np.asarray(weight).sum()), float(tf.reduce_sum(weight))
  (0.0, 0.0)
  """

  def __init__(self, path, variable, ranks, expert):
    self.path = path
    self.variable = variable
    self._ranks = tuple(ranks)
    self._expert = expert
    # Reads the whole weight when some ranks live on other workers (a
    # collective; set by the strategy, `whole_experts.reader`).
    self.gather = None

  @property
  def variables(self):
    """The Keras variables that stand in Keras's variable lists in place of
    the whole weight: the local experts' one."""
    return (self.variable,)

  @property
  def shape(self):
    local = tuple(self.variable.shape)
    return (local[0] * self._expert,) + local[1:]

  ranks = property(lambda self: self._ranks)
  expert = property(lambda self: self._expert)
  dtype = property(lambda self: self.variable.dtype)
  trainable = property(lambda self: self.variable.trainable)
  # Keras reads these from the lists it derives from `weights` (as
  # regularization losses do); split experts refuse regularizers.
  regularizer = property(lambda self: getattr(self.variable, "regularizer",
                                              None))
  constraint = property(lambda self: getattr(self.variable, "constraint",
                                             None))

  def components_by_rank(self):
    """{slot: the first local component holding its experts}."""
    found = {}
    for rank, component in zip(self._ranks, components(self.variable)):
      found.setdefault(rank, component)
    return found

  def spans_workers(self):
    """Whether some expert ranks live on other workers only."""
    return len(self.components_by_rank()) < self._expert

  def _missing(self):
    return sorted(set(range(self._expert)) - set(self.components_by_rank()))

  def numpy(self):
    """The whole weight; when some ranks live on other workers, gathered
    from every worker (each must read the same weights in the same
    order)."""
    missing = self._missing()
    if missing and self.gather is not None:
      return self.gather()
    if missing:
      raise ValueError(
          f"Expert weight {self.path!r}: the experts of rank(s) {missing} "
          f"live on other workers, so the whole weight cannot be read here.")
    by_rank = self.components_by_rank()
    return np.concatenate(
        [np.asarray(by_rank[r].numpy()) for r in range(self._expert)], 0)

  def whole_tensor(self):
    """The whole weight as one tensor (every rank on this worker)."""
    missing = self._missing()
    if missing:
      raise ValueError(
          f"Expert weight {self.path!r}: the experts of rank(s) {missing} "
          f"live on other workers (the expert groups span workers); read it "
          f"with numpy() (a gather every worker makes) or save it with "
          f"tfpar.save_weights(model, path).")
    by_rank = self.components_by_rank()
    return tf.concat([tf.convert_to_tensor(by_rank[r])
                      for r in range(self._expert)], 0)

  @property
  def value(self):
    """The whole weight as one tensor (every rank on this worker)."""
    return self.whole_tensor()

  def assign(self, value):
    """Sets the whole weight: each component takes its slot's experts."""
    value = np.asarray(value)
    if tuple(value.shape) != self.shape:
      raise ValueError(f"Cannot assign a value of shape {value.shape} to "
                       f"expert weight {self.path!r} of shape {self.shape}.")
    pieces = np.split(value, self._expert, axis=0)
    for rank, component in zip(self._ranks, components(self.variable)):
      component.assign(pieces[rank])

  # tf.train.Checkpoint: one entry holding the whole weight, as one device
  # saves it; a restore gives each local component its slot's experts.
  def _serialize_to_tensors(self):
    return self.saved_tensors()

  def _restore_from_tensors(self, restored_tensors):
    return self.restore_tensors(restored_tensors)

  def saved_tensors(self):
    """{checkpoint key: the whole weight}, what a checkpoint saves."""
    return {VARIABLE_VALUE: self.whole_tensor()}

  def restore_tensors(self, restored_tensors):
    """Gives each local component its slot's experts from a checkpoint's
    whole weight; returns the assign ops."""
    pieces = tf.split(restored_tensors[VARIABLE_VALUE], self._expert, axis=0)
    return tf.group([
        component.assign(pieces[rank])
        for rank, component in zip(self._ranks, components(self.variable))])

  def __repr__(self):
    return (f"<ExpertWeight path={self.path} shape={self.shape} "
            f"split in {self._expert} slots>")

