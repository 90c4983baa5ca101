"""Whole values of ZeRO slices spread over several workers.

In a multi-worker job each worker holds only its own replicas' slices of
the optimizer state (and under stage 3 of the weights). Reading a whole
tensor (`get_weights`, saving a checkpoint) then gathers the slices from
every worker: a collective, so every worker must read the same tensors in
the same order, as TensorFlow requires of every multi-worker save. The
chief writes the file, the others only take part in the gathers
(`tfpar.BackupAndRestore` and `tfpar.ModelCheckpoint` do this).

`prefetched(variables)` gathers many tensors in one collective step and
serves them to every read inside the block; outside it, each read gathers
its own tensor.
"""

import contextlib

import tensorflow as tf

from tfpar import watchdog
from tfpar._compat import keras_layers
from tfpar._compat.tf_modules import values_lib
from tfpar.common import strategy_hooks
from tfpar.memory import components
from tfpar.zero import collectives

CHECKPOINT = "checkpoint"  # Phase of these gathers in a CommunicationLog.
# id of a slice variable's distributed value (a stage-3 weight shares its
# slice's) -> (that value, its whole flat NumPy value per column).
_prefetched = {}


def _distributed(slice_variable):
  return keras_layers.storage(slice_variable, slice_variable)


def _columns(strategy):
  """Components of a variable per replica: under SPMD tensor parallelism
  one per device of the replica's tensor group (tensor columns)."""
  return strategy_hooks.of(strategy).zero_traces_per_replica


def is_spread(slice_variable):
  """Whether some of the variable's slices live on other workers."""
  strategy = _distributed(slice_variable).distribute_strategy
  local = len(components(slice_variable)) // _columns(strategy)
  return local < strategy.num_replicas_in_sync


def _gather(variables):
  """Every replica's slices of each variable, concatenated (NumPy), one
  array per tensor column (one, but under SPMD tensor parallelism)."""
  values = [_distributed(v) for v in variables]
  strategy = values[0].distribute_strategy
  names = [v.name for v in variables]
  # SPMD: each trace gathers its column's slices; the first device of a
  # group, whose results leave the replica, gathers every column's.
  over_columns = strategy_hooks.of(strategy).zero_gather_columns

  def gather_on_replica():
    # In a replica context a slice variable reads as the replica's slice.
    pieces = [tf.convert_to_tensor(v) for v in values]
    wholes = collectives.all_gather_many(
        pieces, CHECKPOINT, names, [None] * len(pieces),
        collectives.DEFAULT_BUCKET_BYTES)
    return over_columns(wholes)

  wholes = tf.function(lambda: strategy.run(gather_on_replica))()
  found = [strategy.experimental_local_results(w)[0].numpy() for w in wholes]
  return [list(f) for f in found]


def gather_parts(strategy, parts, name):
  """Every replica's slice concatenated in replica order, as NumPy, when
  `parts` are this worker's replicas' slices (one variable or tensor per
  local replica, in order): a collective every worker calls in turn.

  Args:
    strategy: the multi-worker strategy whose replicas hold the slices.
    parts: this worker's slices, equal vectors.
    name: a name for the collective's record.
  """
  pieces = values_lib.PerReplica(tuple(tf.convert_to_tensor(p)
                                       for p in parts))

  def gather_on_replica(piece):
    return collectives.all_gather_many(
        [piece], CHECKPOINT, [name], [None],
        collectives.DEFAULT_BUCKET_BYTES)[0]

  with watchdog.watching(strategy, f"the gather of weight {name!r}"):
    whole = tf.function(
        lambda: strategy.run(gather_on_replica, args=(pieces,)))()
  return strategy.experimental_local_results(whole)[0].numpy()


def whole_flat(slice_variable, column=0):
  """The whole flattened value of a spread slice variable (a collective
  unless prefetched); under SPMD tensor parallelism, of its components in
  tensor column `column`."""
  found = _prefetched.get(id(_distributed(slice_variable)))
  if found is not None:
    return found[1][column]
  strategy = _distributed(slice_variable).distribute_strategy
  try:
    with watchdog.watching(strategy, f"the gather of weight "
                           f"{slice_variable.name!r}"):
      return _gather([slice_variable])[0][column]
  except tf.errors.OpError as error:
    raise type(error)(error.node_def, error.op, (
        f"{error.message}\nReading the whole value of {slice_variable.name!r}"
        f", whose ZeRO slices are spread over the workers (get_weights(), "
        f"weights, saving), gathers them from every worker: every worker "
        f"makes the same call at the same point of the program, and none "
        f"has exited.")) from error


@contextlib.contextmanager
def prefetched(variables):
  """Serves whole values of the spread `variables` gathered in one step.

  Args:
    variables: slice variables; those not spread over workers are ignored.
      Every worker must pass the same variables in the same order.
  """
  spread = [v for v in variables if is_spread(v)]
  if spread:
    # A peer that never comes to the gather is named after the collective
    # timeout, as in a training step.
    with watchdog.watching(_distributed(spread[0]).distribute_strategy,
                           "the gather of ZeRO slices to save them"):
      gathered = _gather(spread)
    for variable, flat in zip(spread, gathered):
      value = _distributed(variable)
      _prefetched[id(value)] = (value, flat)
  try:
    yield
  finally:
    for variable in spread:
      _prefetched.pop(id(_distributed(variable)), None)
