"""ZeRO stage 3's fused collectives: weights gathered, and their gradients
reduce-scattered, a bucket at a time.

As FSDP gathers one flat parameter per wrapped module, stage 3 cuts the
model into units (`plan`): going down from the model, a layer whose
weights, its sublayers' included, fit in `bucket_bytes` is one unit (the
whole model, when it fits); a larger layer is a unit of its own weights
alone (cut in buckets of up to `bucket_bytes`, as DeepSpeed's
`allgather_bucket_size`), and its sublayers are planned the same way
(under tensor parallelism a unit holds one layer's weights). A unit's call is where its weights live whole: the first read of a weight of
one of its buckets, inside that call, gathers every weight of the bucket
with one all-gather, the other weights of the bucket read the same
tensors, and the gradient of that all-gather is one reduce-scatter of the
whole bucket (`gather`). A unit is recomputed in its backward pass (so its
weights are gathered again there, and live only while it runs), unless one
of its layers draws random numbers.

In a traced step TensorFlow runs collectives of one device in the order
they were created (its launchers' ordering token). The backward pass
creates each unit's gathers and reduce-scatter when it reaches the unit,
last unit first, so a unit's reduce-scatter depends only on the gradients
of that unit and of the layers after it, and is issued as soon as they
are computed, before the backward pass of the units before it.
"""

import dataclasses
import threading

import keras
import tensorflow as tf

from tfpar._compat import distribute
from tfpar._compat import keras_layers
from tfpar._compat.keras_modules import keras_variables
from tfpar.common import instrument
from tfpar.zero import collectives
from tfpar.zero import slices

_runs = threading.local()  # .stack: the unit calls running in this thread.


@dataclasses.dataclass(eq=False)
class Bucket:
  """Weights gathered by one all-gather, and reduced by one reduce-scatter.

  Attributes:
    weights: the Keras variables, in the order they are packed.
    dtype: the dtype they are gathered in (their layer's compute dtype
      under a mixed precision policy).
    column: under tensor parallelism, the device column of the weights.
    site: the fixed-key site of its collectives (`collectives.fixed_key`).
  """
  weights: list
  dtype: tf.DType
  column: object = None
  site: object = None


@dataclasses.dataclass(eq=False)
class Unit:
  """A layer whose call gathers `buckets` (and is recomputed in the
  backward pass when `recomputed`)."""
  layer: object
  buckets: list
  recomputed: bool


def is_lookup(layer):
  """A Keras Embedding that only looks rows up (not a tied output
  projection, keras-hub's ReversibleEmbedding with `reverse=True`)."""
  import inspect  # pylint: disable=g-import-not-at-top
  return (isinstance(layer, keras.layers.Embedding) and
          "reverse" not in inspect.signature(layer.call).parameters)


def _read_dtype(layer, weight):
  """The dtype `weight` has when `layer` reads it (Keras's autocast)."""
  compute = tf.as_dtype(layer.compute_dtype)
  if not (layer.autocast and compute.is_floating):
    return tf.as_dtype(weight.dtype)
  with keras_variables.AutocastScope(compute.name):
    return keras_layers.autocast(weight, tf.zeros([0], weight.dtype)).dtype


def plan(model, bucket_bytes, is_sharded=lambda weight: True,
         column=lambda weight: None):
  """The units and buckets of stage 3's gathers for `model`.

  Args:
    model: a built Keras model (or layer).
    bucket_bytes: the most bytes of weights (in their own dtype) one
      bucket holds; a larger weight is a bucket of its own.
    is_sharded: which weights are gathered (ZeRO-3's sliced weights);
      the others are left out.
    column: the device column of a weight (tensor parallelism), or None.

  Returns:
    A list of `Unit`s, outermost first; every sharded weight read by a
    plain Embedding lookup is left out (it is gathered on its own, and its
    gradient stays sparse).

  Example:

  >>> import keras
  >>> model = keras.Sequential([keras.Input((4,)),
  ...                           keras.layers.Dense(8, name="dense"),
  ...                           keras.layers.Dense(2, name="dense_1")],
  ...                          name="sequential")
  >>> units = plan(model, bucket_bytes=4096)  # 232 bytes: one unit
  >>> [(u.layer.name, [len(b.weights) for b in u.buckets]) for u in units]
  [('sequential', [4])]
  >>> units = plan(model, bucket_bytes=160)   # 160 bytes (kernel 128)
  >>> [(u.layer.name, [len(b.weights) for b in u.buckets]) for u in units]
  [('dense', [2]), ('dense_1', [2])]
  >>> units = plan(model, bucket_bytes=4)     # a bucket per weight
  >>> [(u.layer.name, [len(b.weights) for b in u.buckets]) for u in units]
  [('dense', [1, 1]), ('dense_1', [1, 1])]
  """
  units, claimed = [], set()

  def sharded(layers):
    found = {}
    for sub in layers:
      for weight in keras_layers.variable_lists(sub)[0]:
        if is_sharded(weight) and id(weight) not in claimed:
          found.setdefault(id(weight), (sub, weight))
    return list(found.values())

  def add(layer, members, recomputed):
    if members:
      claimed.update(id(weight) for _, weight in members)
      units.append(Unit(layer, _cut(members, bucket_bytes, column),
                        recomputed))

  def visit(layer):
    subtree = keras_layers.flatten_layers(layer)
    members = sharded(subtree)
    lookups = any(is_lookup(sub) for sub in subtree)
    random = any(keras_layers.seed_generators(sub) for sub in subtree)
    size = sum(_nbytes(weight) for _, weight in members)
    # Tensor-parallel layers run their shards through calls of their own
    # (tested as units of one layer only).
    split = any(column(weight) for _, weight in members) and any(
        sub is not layer for sub, _ in members)
    if (members and size <= bucket_bytes and not lookups and not random
        and not split):
      add(layer, members, recomputed=True)
      return
    if not is_lookup(layer):
      add(layer, sharded([layer]), recomputed=not random)
    for child in keras_layers.flatten_layers(layer, include_self=False,
                                             recursive=False):
      visit(child)

  visit(model)
  return units


def _nbytes(weight):
  return int(weight.shape.num_elements()) * tf.as_dtype(weight.dtype).size


def _cut(members, bucket_bytes, column):
  """(layer, weight) pairs in order, cut into buckets of one column and
  read dtype, each at most `bucket_bytes` (a larger weight alone)."""
  open_buckets, cut = {}, []  # (column, dtype) -> (bucket, bytes)
  for layer, weight in members:
    key = (column(weight) or None, _read_dtype(layer, weight))
    bucket, used = open_buckets.get(key, (None, 0))
    size = _nbytes(weight)
    if bucket is None or used + size > bucket_bytes:
      bucket, used = Bucket([], key[1], key[0]), 0
      cut.append(bucket)
    bucket.weights.append(weight)
    open_buckets[key] = (bucket, used + size)
  return cut


def running(unit):
  """A context manager: `unit`'s call runs; reads of its weights inside it
  use its buckets' gathers (one per bucket)."""
  return _Run(unit)


class _Run:

  def __init__(self, unit):
    self.unit, self.gathered = unit, {}

  def __enter__(self):
    stack = getattr(_runs, "stack", None)
    if stack is None:
      stack = _runs.stack = []
    stack.append(self)
    return self

  def __exit__(self, *exc):
    _runs.stack.pop()


def gathered(weight, phase):
  """`weight` whole, from its bucket's all-gather in the unit call running
  in this replica (gathering the bucket at the first read); None when its
  unit is not running, or when it is read in another dtype than its
  bucket's (a weight read by another layer: the caller gathers it
  alone)."""
  place = getattr(weight, "_tfpar_zero_bucket", None)
  if place is None:
    return None
  unit, bucket, index = place
  for run in reversed(getattr(_runs, "stack", [])):
    if run.unit is unit:
      break
  else:
    return None
  probe = keras_layers.autocast(weight, tf.zeros([0], weight.dtype))
  if probe.dtype != bucket.dtype:
    return None
  if id(bucket) not in run.gathered:
    run.gathered[id(bucket)] = gather(bucket, phase)
  return run.gathered[id(bucket)][index]


def gather(bucket, phase):
  """Every weight of `bucket` whole (in the bucket's dtype), from one
  all-gather of the replicas' slices; the gradient is one reduce-scatter
  of the bucket, in the weights' own dtype. Each weight is recorded in
  open `tfpar.CommunicationLog`s with the bytes it adds."""
  context = tf.distribute.get_replica_context()
  count = context.num_replicas_in_sync
  launcher = collectives.launcher(context, bucket.column)
  device = distribute.launcher_device(launcher)
  weights = bucket.weights
  sizes = [slices.components(w)[0].shape[0] for w in weights]

  @tf.custom_gradient
  def fused(*pieces):
    lows = [tf.cast(p, bucket.dtype) for p in pieces]
    if bucket.dtype == tf.bfloat16:  # CPU collectives take no bfloat16.
      lows = [tf.bitcast(low, tf.float16) for low in lows]
    for weight, low in zip(weights, lows):
      instrument.record("all-gather", phase,
                        instrument.moved_bytes(low, count - 1), weight.path)
    joined = tf.concat(lows, 0) if len(lows) > 1 else lows[0]
    key = collectives.fixed_key(launcher, bucket.site, "all-gather", phase,
                                joined.dtype)
    whole = distribute.all_gather(launcher, joined, key)
    with tf.device(device):
      if bucket.dtype == tf.bfloat16:
        whole = tf.bitcast(whole, tf.bfloat16)
      parts = tf.split(tf.reshape(whole, [count, -1]), sizes, axis=1)
      outputs = [tf.reshape(tf.reshape(part, [-1])[:w.shape.num_elements()],
                            w.shape) for w, part in zip(weights, parts)]

    def grad(*upstreams):
      return _reduce_scatter(bucket, upstreams, pieces, sizes, count,
                             launcher)
    return outputs, grad
  storage = [tf.convert_to_tensor(keras_layers.storage(w)) for w in weights]
  return fused(*storage)


def _reduce_scatter(bucket, upstreams, pieces, sizes, count, launcher):
  """Each replica's slice of the summed gradient of every weight of
  `bucket`: one all-to-all of the bucket, then a local sum (CPU has no
  reduce-scatter kernel)."""
  chunks = []
  for weight, upstream, piece, size in zip(bucket.weights, upstreams,
                                           pieces, sizes):
    if upstream is None:
      upstream = tf.zeros(weight.shape, piece.dtype)
    upstream = tf.cast(tf.convert_to_tensor(upstream), piece.dtype)
    chunk = tf.reshape(slices.padded_flat(upstream, size * count),
                       [count, size])
    instrument.record("reduce-scatter", instrument.BACKWARD,
                      instrument.moved_bytes(chunk[0], count - 1),
                      weight.path)
    chunks.append(chunk)
  joined = tf.concat(chunks, axis=1) if len(chunks) > 1 else chunks[0]
  key = collectives.fixed_key(launcher, bucket.site, "reduce-scatter",
                              instrument.BACKWARD, joined.dtype)
  received = distribute.all_to_all(launcher, joined, key)
  with tf.device(distribute.launcher_device(launcher)):
    summed = tf.reduce_sum(tf.reshape(received, [count, -1]), axis=0)
    return tf.split(summed, sizes)
