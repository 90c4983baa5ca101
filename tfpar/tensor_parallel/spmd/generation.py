"""keras-hub's `CausalLM.generate` under tensor parallelism, with the
key/value cache split by heads like the attention.

keras-hub traces `generate_step` in a `tf.function` of its own, outside
the strategy's replicas: `_build_cache` seeds a cache with one forward pass
of the prompt (`call_with_cache` on zeros), then the sampler's while loop
calls `call_with_cache` once per new token. tfpar's hook
(`_compat/keras_hub_generate.py`) makes `generate` call the function made
here instead, which traces the same `generate_step` with the model's
`call_with_cache` run once per device of every tensor group
(`PerDeviceRuns.run_per_device`): split layers compute their shards and
meet in the group's collectives as in training, and each device's
attention, running with its share of the heads (`layers._install_heads`),
writes its own heads' keys and values. So each device carries a cache of
`[batch, layers, 2, length, local key/value heads, head dim]`: 1 / tensor
of one device's when the key/value heads split, the heads its query heads
use when they are fewer than the devices. The whole cache `_build_cache`
makes is never computed: each device makes its own zeros (the whole
zeros, unused, are pruned from the function).

The loop itself stays outside the per-device traces. TensorFlow keys a
collective by its instance key and the frame of the loop running it, and a
loop's frame is named after its While op: one loop per device trace gives
every device its own frame name, and the group's collectives never meet
(measured: generation hung at its first token). With one loop, every
device's work of a step is in the same frame, as under `MirroredStrategy`;
the loop carries the cache as a per-device value. The sampler runs once
per step in that loop, on the first device's logits (the group's gathered
logits, the same on all of its devices): greedy and seeded samplers draw
as on one device, and the seed advances once.

Every data replica runs the whole batch (the same work; the first tensor
group's tokens are returned): one device's tokens, whatever the data size.
"""

import collections
import contextlib
import inspect

import tensorflow as tf

from tfpar._compat import keras_hub_generate
from tfpar._compat import keras_layers
from tfpar.engine.per_device import checks as per_device_checks
from tfpar.engine.per_device import collectives
from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import layouts

# keras-hub's cache: [batch, layers, 2 (key, value), length, heads, dim].
CACHE_RANK = 6
HEADS_AXIS = 4

CacheHeads = collections.namedtuple("CacheHeads", "whole local sharers")


def cache_heads(model, tensor_size):
  """The key/value heads of the cache of `model` (sharded): whole, per
  device, and devices sharing a head (1 when they split); None when no
  attention is split by heads.

  Raises:
    ValueError: attention layers with different head counts, or some
      split by heads and others not (their caches would not stack).
  """
  layers = {id(layout.layer): layout for layout in
            getattr(model, "_tfpar_layouts", None) or ()
            if layout.kind == layouts.HEADS}
  found, whole_layers = set(), []
  for layer in keras_layers.flatten_layers(model, include_self=False):
    family = families.family_of(layer)
    if family is None:
      continue
    if id(layer) not in layers:
      whole_layers.append(layer.name)
      continue
    _, whole = family.head_counts(layer)
    local = families.key_value_heads_per_device(layer, family, tensor_size)
    found.add((whole, local))
  if found and whole_layers or len(found) > 1:
    raise ValueError(
        f"generate() under tensor parallelism splits the key/value cache of "
        f"every attention layer alike, by heads. Model {model.name!r} has "
        f"attention layers with (key/value heads, heads per device) "
        f"{sorted(found)} and layers not split by heads {whole_layers}: "
        f"split every attention layer by heads (the built-in plan) or "
        f"none.")
  if not found:
    return None
  whole, local = found.pop()
  return CacheHeads(whole, local,
                    tensor_size // whole if whole < tensor_size else 1)


def _is_zeros(tensor):
  """Whether graph `tensor` is the zeros of `ops.zeros` (a Fill of 0, or a
  small constant of zeros)."""
  op = getattr(tensor, "op", None)
  if op is None or not hasattr(op, "inputs"):
    return False
  if op.type == "Fill":
    value = tf.get_static_value(op.inputs[1])
    return value is not None and not value.any()
  if op.type == "Const":
    value = tf.get_static_value(tensor)
    return value is not None and not value.any()
  return False


def local_cache(cache, heads, tensor_index, model_name):
  """This device's part of `cache`: as it comes when it holds the device's
  heads already; else (the whole cache `_build_cache` made) new zeros of
  the device's heads, or its heads' slice when the cache is not zeros.

  Raises:
    ValueError: the cache is not `[batch, layers, 2, length, heads, dim]`
      with the model's whole or per-device key/value heads.
  """
  shape = cache.shape
  if (shape.rank != CACHE_RANK or
      shape[HEADS_AXIS] not in (heads.whole, heads.local)):
    raise ValueError(
        f"generate() under tensor parallelism splits a key/value cache of "
        f"shape [batch, layers, 2, length, key/value heads, head dim] by "
        f"heads ({heads.whole} whole, {heads.local} per device); model "
        f"{model_name!r} passed call_with_cache a cache of shape {shape}.")
  if shape[HEADS_AXIS] == heads.local:
    return cache
  start = tensor_index // heads.sharers * heads.local
  if not _is_zeros(cache):
    return cache[:, :, :, :, start:start + heads.local]
  if shape.is_fully_defined():
    dims = shape.as_list()
    dims[HEADS_AXIS] = heads.local
  else:  # The Fill's own dims: reading the cache's shape would keep it.
    dims = tf.tensor_scatter_nd_update(cache.op.inputs[0], [[HEADS_AXIS]],
                                       [heads.local])
  return tf.zeros(dims, cache.dtype)


def _first(value):
  if isinstance(value, tf.distribute.DistributedValues):
    return value.values[0]
  return value


def _per_device_call_with_cache(extended, model):
  """A `call_with_cache` wrapper (for `swapped_call_with_cache`) that runs
  the model's own once per device and returns the first device's logits
  and hidden states and the per-device caches."""
  heads = cache_heads(model, extended.tensor_size)

  def wrap(original, bind):
    def call_with_cache(*args, **kwargs):
      bound = bind(*args, **kwargs)
      name = keras_hub_generate.CACHE_ARGUMENT

      def on_device(cache):
        arguments = dict(bound.arguments)
        if heads is not None:
          arguments[name] = local_cache(
              cache, heads, collectives.current_slot().tensor_index,
              model.name)
        else:
          arguments[name] = cache
        call = inspect.BoundArguments(bound.signature, arguments)
        return original(*call.args, **call.kwargs)

      result = extended.run_per_device(on_device,
                                       args=(bound.arguments[name],))
      if not isinstance(result, tuple) or len(result) != 3:
        raise ValueError(
            f"generate() under tensor parallelism expects {type(model).__name__}"
            f".call_with_cache to return (logits, hidden_states, cache), as "
            f"keras-hub's decoder models do; it returned {result!r}.")
      logits, hidden_states, cache = result
      return _first(logits), _first(hidden_states), cache
    return call_with_cache
  return wrap


def check_generate(model, sequence_parallel):
  """Refuses what `generate` cannot run under tensor parallelism.

  Raises:
    ValueError: `run_eagerly=True` (the per-device traces need a
      `tf.function`), or sequence parallelism (one new token per step has
      no sequence to slice).
  """
  if model.run_eagerly:
    raise ValueError(
        f"{per_device_checks.EAGER_REFUSAL}. Received: run_eagerly=True on "
        f"model {model.name!r} calling generate(); compile with "
        f"run_eagerly=False.")
  if sequence_parallel:
    raise ValueError(
        f"generate() under TensorParallelStrategy(sequence_parallel=True) "
        f"is not supported: each step computes one new token, which has no "
        f"sequence to slice over the tensor axis. Received: "
        f"sequence_parallel=True for model {model.name!r}; save its weights "
        f"and load them into the model built under a strategy made with "
        f"sequence_parallel=False (the same mesh) to generate.")


def generate_function(extended, model, sequence_parallel=False,
                      placing=None):
  """The function keras-hub's `generate` calls (`fn(inputs,
  stop_token_ids=None)`): `model.generate_step` traced in a `tf.function`
  with `call_with_cache` run per device (see the module).

  Args:
    extended: the strategy's `PerDeviceExtended`.
    model: the keras-hub `CausalLM`.
    sequence_parallel: whether the strategy slices sequences (refused).
    placing: optional `placing(extended, model)`, a context manager active
      while the step is traced (pipeline stages place their layers).
  """
  check_generate(model, sequence_parallel)
  step = model.generate_step

  @tf.function
  def generate(inputs, stop_token_ids=None):
    wrap = _per_device_call_with_cache(extended, model)
    with keras_hub_generate.swapped_call_with_cache(model, wrap), (
        placing(extended, model) if placing else contextlib.nullcontext()):
      return step(inputs, stop_token_ids=stop_token_ids)

  def run(inputs, stop_token_ids=None):
    extended.prepare_pending_models()
    return generate(inputs, stop_token_ids=stop_token_ids)
  return run
