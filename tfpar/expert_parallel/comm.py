"""The communication of expert parallelism, issued by each replica.

* `all_to_all`: a replica's token buffer, cut into one chunk per member of
  its expert group, is exchanged so that member j receives every member's
  chunk j (TensorFlow's `CollectiveAllToAllV2`, which runs on CPU). Its
  gradient is the same exchange run backwards: another all-to-all.
* `sum_over_expert_data_group`: the gradients of a replica's experts,
  summed over the replicas that hold the same experts.
* `sum_over_replicas`: the router statistics of the load-balancing loss,
  summed over every replica (differentiable: its gradient is itself).

Each op is recorded in open `tfpar.CommunicationLog`s with the bytes this
device sends to other devices.
"""

import tensorflow as tf

from tfpar._compat import distribute
from tfpar.common import instrument

ALL_TO_ALL = "all-to-all"
ALL_REDUCE = "all-reduce"
OPTIMIZER = "optimizer"


def _sent_bytes(chunks):
  """Bytes of the chunks a member sends to the other members."""
  size = instrument.moved_bytes(chunks, 1)
  count = chunks.shape[0]
  return None if size is None else size * (count - 1) // count


def _exchange(chunks, launcher):
  received = distribute.all_to_all(launcher, chunks)
  return tf.reshape(received, tf.shape(chunks))


def all_to_all(chunks, launcher, layer):
  """Exchanges `chunks[j]` with member j of the expert group.

  Args:
    chunks: a tensor whose first dimension is the expert-group size; chunk
      j goes to the group's member j.
    launcher: this replica's `CollectiveReplicaLauncher` of its expert
      group (`Launchers.all_to_all`).
    layer: the MoE layer's name (for the log).

  Returns:
    A tensor shaped like `chunks` whose chunk i came from member i.
  """
  if distribute.group_size(launcher) == 1:
    return chunks

  @tf.custom_gradient
  def _all_to_all(value):
    def grad(upstream):
      received = _exchange(upstream, launcher)
      instrument.record(ALL_TO_ALL, instrument.BACKWARD,
                        _sent_bytes(upstream), layer, received)
      return received
    return _exchange(value, launcher), grad

  received = _all_to_all(chunks)
  instrument.record(ALL_TO_ALL, instrument.FORWARD, _sent_bytes(chunks),
                    layer, received)
  return received


def sum_over_expert_data_group(values, launcher, name):
  """The sums of `values` (gradients) over the expert-data group.

  Args:
    values: dense tensors, this replica's gradients of its experts.
    launcher: this replica's expert-data launcher (`Launchers.expert_data`).
    name: for the log.
  """
  count = distribute.group_size(launcher)
  if count == 1 or not values:
    return list(values)
  flat = tf.concat([tf.reshape(v, [-1]) for v in values], 0)
  instrument.record(ALL_REDUCE, OPTIMIZER,
                    instrument.moved_bytes(flat, 2) * (count - 1) // count,
                    name)
  summed = launcher.all_reduce(flat)
  pieces = tf.split(summed, [v.shape.num_elements() for v in values])
  return [tf.reshape(p, v.shape) for p, v in zip(pieces, values)]


def sum_over_replicas(value, launcher, layer):
  """The sum of `value` over every replica, differentiable (the gradient
  of a sum over replicas is the sum of the upstream gradients).

  It launches its collective from the replica itself: a `merge_call`
  (`ReplicaContext.all_reduce`) would let the replica threads interleave
  inside the model's call, and Keras's per-layer lists of `add_loss`
  values, which the replicas share, would mix their losses.

  Args:
    value: a small dense tensor.
    launcher: this replica's launcher of every replica
      (`Launchers.everyone`).
    layer: for the log.
  """
  count = distribute.group_size(launcher)
  if count == 1:
    return value

  def ring_bytes(tensor):
    return instrument.moved_bytes(tensor, 2) * (count - 1) // count

  @tf.custom_gradient
  def _sum(tensor):
    def grad(upstream):
      instrument.record(ALL_REDUCE, instrument.BACKWARD, ring_bytes(upstream),
                        layer)
      return launcher.all_reduce(upstream)
    return launcher.all_reduce(tensor), grad

  instrument.record(ALL_REDUCE, instrument.FORWARD, ring_bytes(value), layer)
  return _sum(value)
