"""keras-hub attention layers split by heads.

(`keras.layers.MultiHeadAttention` runs tfpar's own head-split copy of its
call: `stock_attention.py`.)

keras-hub's attention layers (Llama, Mistral, Qwen, Gemma, GPT-2's cached
attention...) each have their own `call`: rotary embeddings, grouped
key/value heads, soft caps. Rather than re-implementing each, tfpar runs the
layer's own `call` once per device of the tensor group, as Megatron runs a
block on every rank: with the head counts set to the device's share, the
query/key/value projections returning the device's heads and the output
projection its partial sum, which the group then adds up (Megatron's
row-parallel reduce). Which attributes hold the projections and the head
counts comes from `families.py`.

Key/value heads: with at least as many as the tensor size they are split
with the query heads. With fewer (multi-query and grouped-query models,
when tensor % key_value_heads == 0) the key/value kernels stay whole and
each head is computed once, by the first device sharing it, and handed to
the others, as one device repeats it (`shared_heads.py`); in Gemma and
under ZeRO-3 every sharing device computes it, as Megatron and vLLM
replicate them.
"""

import tensorflow as tf

from tfpar._compat.keras_modules import backend
from tfpar.tensor_parallel import comm
from tfpar.tensor_parallel import compute
from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import layers as layers_lib
from tfpar.tensor_parallel import shared_heads
from tfpar.tensor_parallel import tags



def _index_of_current_device(devices):
  """The position in `devices` of the device ops are placed on now.

  A projection split by heads learns its shard from the replay of its
  attention layer; when ZeRO-3 runs it again to recompute its backward
  pass, the replay is over, but the backward pass of shard k is placed on
  device k (`compute.on_device`)."""
  current = tf.DeviceSpec.from_string(tf.constant(0.0).device)
  for index, device in enumerate(devices):
    spec = tf.DeviceSpec.from_string(device)
    if (spec.device_type, spec.device_index, spec.task) == (
        current.device_type, current.device_index, current.task):
      return index
  raise ValueError(
      f"A projection split by heads ran outside its attention layer, on "
      f"{current.to_string() or 'no device'}, which is not one of its "
      f"tensor group's devices {list(devices)}.")


def replay(layout, group, sequence_parallel, float32_sums):
  """The tensor-parallel `call` of a registered attention layer.

  With `float32_sums` its inputs cross in float32 and its projections take
  them without Keras's autocast (they cast the operands themselves,
  `layers_lib.project`), so the input gradients coming back are summed in
  float32; its output projection's partial products are summed in float32
  too. Each projection gets a float32 copy of its own, so that its input
  gradient is rounded alone, as on one device (`_spread`). Its other
  sublayers autocast the inputs back to the compute dtype, exactly
  (float32 copies of compute-dtype values)."""
  layer = layout.layer
  family = families.family_of(layer)
  parts = family.projections(layer)
  original_call = type(layer).call.__get__(layer)
  state = {"index": None, "sharing": None, "taps": {}}
  input_roles = [role for role in parts if role != "output"]
  rotary = shared_heads.rotary_of(layer)
  exchange = shared_heads.Exchange(rotary) if rotary is not None else None
  calls = {}

  def projection_call(role, dense):
    def call(inputs, training=None):
      del training
      # This projection's own float32 copy of a spread input, if it has one.
      inputs = state["taps"].get(id(inputs), {}).get(role, inputs)
      index = state["index"]
      if index is None:  # Run again in the backward pass (ZeRO-3).
        index = _index_of_current_device(group())
      if role == "output":
        return layers_lib.project(dense, inputs, index, dense.equation,
                                  partial=True, float32=float32_sums)
      sharing = state["sharing"]
      if role == "query" or not sharing:
        y = layers_lib.project(dense, inputs, index, dense.equation,
                               float32=float32_sums)
      elif sharing.computes(index):
        y = shared_heads.head_slice(dense, inputs, sharing.head(index),
                                    float32_sums)
      else:
        y = shared_heads.placeholder(dense, inputs)  # Handed out instead.
      y = y if dense.activation is None else dense.activation(y)
      if role != "query" and sharing and sharing.handed_out:
        y = exchange.projected(role, y)
      return y
    return call

  for role, dense in parts.items():
    calls[role] = projection_call(role, dense)
    object.__setattr__(dense, "call", calls[role])
    if float32_sums:
      dense.autocast = False

  def call(*args, **kwargs):
    devices = group()
    tensor_size = len(devices)
    per_device = families.key_value_heads_per_device(layer, family, tensor_size)
    sharing = shared_heads.sharing_of(
        layer, family, tensor_size, per_device, rerun=any(  # ZeRO-3.
            vars(parts[role]).get("call") is not calls[role]
            for role in ("key", "value")))
    if sharing:
      per_device = sharing.key_value_heads_seen
    local = family.local_attributes(layer, tensor_size, per_device)
    leaves = tf.nest.flatten((args, kwargs))
    tensors = [x for x in leaves if tf.is_tensor(x)]
    copies, taps = {}, {}
    for x in tensors:
      if id(x) not in copies:
        copies[id(x)], taps[id(x)] = _spread(x, devices, layer.name,
                                             float32_sums, input_roles)
    tap_order = [(id(x), role) for x in _distinct(tensors)
                 for role in taps[id(x)][0]]
    mask = backend.get_keras_mask(args[0]) if args else None

    partials, received = [], {}
    for index, device in enumerate(devices):
      heads_in = received.pop(index, [])
      def shard_fn(*pieces, index=index, count=len(heads_in)):
        # Inputs: the plain copies, the projections' own copies and the
        # key/value heads handed to this device (`count`).
        heads_given = pieces[len(pieces) - count:]
        pieces = pieces[:len(pieces) - count]
        plain, role_pieces = pieces[:len(tensors)], pieces[len(tensors):]
        by_tensor = {}
        for (key, role), piece in zip(tap_order, role_pieces):
          by_tensor.setdefault(key, {})[role] = piece
        state["taps"] = {id(piece): by_tensor[id(x)]
                         for x, piece in zip(tensors, plain)
                         if id(x) in by_tensor}
        it = iter(plain)
        new_args, new_kwargs = tf.nest.pack_sequence_as(
            (args, kwargs),
            [next(it) if tf.is_tensor(x) else x for x in leaves])
        saved = {name: getattr(layer, name) for name in local}
        state.update(index=index, sharing=sharing)
        try:
          for name, value in local.items():
            object.__setattr__(layer, name, value)
          if sharing and sharing.handed_out:
            result, heads_out = exchange.run(
                lambda: original_call(*new_args, **new_kwargs), sharing,
                index, heads_given)
          else:
            result, heads_out = original_call(*new_args, **new_kwargs), []
        finally:
          for name, value in saved.items():
            object.__setattr__(layer, name, value)
          state["index"], state["taps"] = None, {}
        if isinstance(result, (tuple, list)):
          raise ValueError(
              f"Layer {layer.name!r} ({type(layer).__name__}) returned "
              f"{len(result)} values (a key/value cache or attention "
              f"scores); tfpar's tensor-parallel attention computes the "
              f"attention output only (training, evaluation, prediction "
              f"without a cache).")
        return (result, *heads_out) if heads_out else result
      result = compute.on_device(
          device, shard_fn, *[copies[id(x)][index] for x in tensors],
          *[taps[key][index][role] for key, role in tap_order], *heads_in)
      targets = sharing.receivers(index) if sharing else ()
      if targets:  # [key, value] for each device sharing its heads.
        result, moved = result[0], comm.hand_out(
            result[1:], [devices[t] for t in targets for _ in range(2)],
            device, layer.name)
        for position, target in enumerate(targets):
          received[target] = moved[2 * position:2 * position + 2]
      partials.append(result)
    output = layers_lib.combine(partials, devices, layer.name,
                                layers_lib.finisher(parts["output"]),
                                sequence_parallel)
    if mask is not None:
      backend.set_keras_mask(output, mask)
    return output

  return call


def _distinct(tensors):
  seen = {}
  for x in tensors:
    seen.setdefault(id(x), x)
  return list(seen.values())


def _spread(x, devices, name, float32_sums, roles):
  """(`x` on every device, [{role: that role's own copy}] per device).

  With `float32_sums`, a half-precision `x` crosses in float32 once and
  each projection taking it gets a copy of its own, whose input gradient
  is summed over the devices in float32 and rounded alone before the
  projections' gradients are added (`comm.broadcast_uses`), as one device
  rounds each projection's input gradient; without it, or with sequence
  slices, the projections share `layers_lib.spread`'s copy.

  The plain copy is the first projection's (the query's): its gradient,
  zero in the registered families (only projections take the input),
  joins that projection's before the sum over devices instead of taking a
  reduction of its own."""
  if (not float32_sums or x.dtype not in (tf.bfloat16, tf.float16) or
      tags.sequence_chunks(x, devices) is not None):
    whole = layers_lib.spread(x, devices, name, float32_sums)
    return whole, [{} for _ in devices]
  with tf.device(x.device or None):
    wide = tf.cast(x, tf.float32)
  per_device = comm.broadcast_uses(wide, len(roles), devices, name, x.dtype)
  return ([uses[0] for uses in per_device],
          [dict(zip(roles, uses)) for uses in per_device])
