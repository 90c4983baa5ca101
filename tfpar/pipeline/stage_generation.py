"""keras-hub's `CausalLM.generate` under pipeline stages of tensor groups
(3D: `TensorStagesExtended`).

keras-hub's `call_with_cache` calls the backbone's layers one after the
other (embedding, every transformer layer with its slice of the key/value
cache, the final norm, the reverse embedding), outside the pipeline's
schedule. Generation runs it as tensor parallelism does
(`tensor_parallel/spmd/generation.py`: once per tensor column, the cache
split by heads, one token loop), and this module places each call: while
the generate function is traced, every layer a stage owns runs on its
stage's device of the running column (stage s, column k: device
`s x tensor + k` of the replica, where its shards live and its tensor
group's collectives meet), as the pipeline's own `StageRunner` does in
training. Only activations of one token and each layer's slice of the
cache cross between stages; no weight leaves its stage.

Stages run one after the other for each token (a new token depends on the
last one's logits): generation is not pipelined.
"""

import contextlib

import keras
import tensorflow as tf

from tfpar.engine.per_device import collectives
from tfpar.pipeline import placement


@contextlib.contextmanager
def layers_on_stage_devices(extended, model):
  """While active, each layer a stage of `model` owns runs its calls made
  inside a per-device trace on that stage's device of the trace's column.

  Args:
    extended: the `TensorStagesExtended` of `model`.
    model: a model cut into stages (`_tfpar_stage_plan`).

  Raises:
    ValueError: `model` was not cut into stages.
  """
  plan = getattr(model, "_tfpar_stage_plan", None)
  if plan is None:
    raise ValueError(
        f"generate() under pipeline stages with a tensor axis needs model "
        f"{model.name!r} cut into stages first; it was not (create it in "
        f"the strategy's scope).")
  swapped = {}
  for stage in plan.stages:
    shared = {id(layer) for layer in stage.shared}
    for layer in stage.layers:
      if (isinstance(layer, keras.layers.Layer) and
          id(layer) not in shared and id(layer) not in swapped):
        swapped[id(layer)] = (layer, layer.__dict__.get("call"))
        object.__setattr__(layer, "call", _on_stage_device(
            extended, layer.call, stage.index))
  try:
    yield
  finally:
    for layer, own_call in swapped.values():
      if own_call is None:
        layer.__dict__.pop("call", None)
      else:
        object.__setattr__(layer, "call", own_call)


def _on_stage_device(extended, call, stage_index):
  column = placement.stage_column(stage_index, extended.pipeline_size,
                                  extended.tensor_size)

  def placed(*args, **kwargs):
    slot = collectives.current_slot()
    if slot is None:
      return call(*args, **kwargs)
    with tf.device(extended.current_group()[column + slot.tensor_index]):
      return call(*args, **kwargs)
  return placed
