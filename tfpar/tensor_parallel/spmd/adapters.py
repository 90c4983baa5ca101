"""LoRA and quantized layers of a model sharded under SPMD, after sharding.

A model is sharded when the strategy's scope closes (or at its first
`fit` / `predict`); keras-hub users call `backbone.enable_lora(rank)`
after building it, and save / load the factors with the backbone's
`save_lora_weights` / `load_lora_weights`. What `install` does to each
sharded model:

* `enable_lora` on any of its Dense / EinsumDense layers creates the
  factors whole, as one device draws them (Keras's own `enable_lora` run
  with the layer's whole kernel in view, in the strategy's scope), then
  lays them out as the sharded layer's plan does (`lora.py`): the factor
  holding the kernel's split axis split, the other whole on every device.
  Under pipeline stages each layer's factors are created on its stage's
  devices and split over its stage's tensor groups (`placing`).
* A LoRA or quantized layer saves and loads what Keras's own code writes
  and reads on one device (LoRA merged into the kernel, int8 kernels with
  their scales, in its order), through the whole weights.
* A keras-hub backbone's `save_lora_weights` / `load_lora_weights` read
  and write whole factors.
* `quantize` on a sharded layer is refused: its kernel's scales would be
  taken per shard.
"""

import contextlib
import dataclasses

import keras

from tfpar._compat import keras_layers
from tfpar.engine import spread
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import lora
from tfpar.tensor_parallel.spmd import weights as weights_lib


def _adapted(layer):
  return bool(getattr(layer, "lora_enabled", False) or
              getattr(layer, "quantization_mode", None))


def install(model, strategy, tensor_size, groups=None, placing=None):
  """Adapts every layer of a just-sharded `model` (idempotent).

  Args:
    model: the sharded model.
    strategy: its strategy (new factors are created in its scope).
    tensor_size: devices per tensor group.
    groups: the `collectives.TensorGroups` its split layers compute over.
    placing: optional `placing(layer)`: `(groups, context)`, the tensor
      groups `layer` computes over and a context manager in which its new
      variables are created where its own live (pipeline stages); None:
      `groups` and the strategy's default place.
  """
  for layer in keras_layers.flatten_layers(model, include_self=True):
    if getattr(layer, "_tfpar_adapters", False):
      continue
    if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense,
                          keras.layers.Embedding)):
      _refuse_quantize(layer, model)
      _keras_saving(layer)
      if not isinstance(layer, keras.layers.Embedding):
        _late_enable_lora(layer, strategy, tensor_size, groups, placing)
    if callable(getattr(layer, "save_lora_weights", None)):
      for name in ("save_lora_weights", "load_lora_weights"):
        _with_whole_attributes(layer, name)
    object.__setattr__(layer, "_tfpar_adapters", True)


def _refuse_quantize(layer, model):
  def quantize(mode=None, *args, **kwargs):
    del args, kwargs
    raise ValueError(
        f"Cannot quantize layer {layer.name!r} (mode={mode!r}) of model "
        f"{model.name!r}: the model is already sharded, and a quantized "
        f"kernel's scales must be taken over the whole kernel. Call "
        f"model.quantize({mode!r}) before the model is sharded: inside "
        f"strategy.scope() where it is built, before the scope closes and "
        f"before the first fit / predict.")
  object.__setattr__(layer, "quantize", quantize)


def _keras_saving(layer):
  """A LoRA or quantized layer saves as Keras's own code does, through
  its whole weights; the others keep tfpar's logical saving."""
  logical_save, logical_load = (layer.save_own_variables,
                                layer.load_own_variables)
  cls = type(layer)

  def save_own_variables(store):
    if not _adapted(layer):
      return logical_save(store)
    with weights_lib.whole_attributes([layer]):
      return cls.save_own_variables(layer, store)

  def load_own_variables(store):
    if not _adapted(layer):
      return logical_load(store)
    with weights_lib.whole_attributes([layer]):
      return cls.load_own_variables(layer, store)

  object.__setattr__(layer, "save_own_variables", save_own_variables)
  object.__setattr__(layer, "load_own_variables", load_own_variables)


def _with_whole_attributes(backbone, name):
  original = getattr(backbone, name)

  def method(*args, **kwargs):
    layers = keras_layers.flatten_layers(backbone, include_self=True)
    with weights_lib.whole_attributes(layers):
      return original(*args, **kwargs)
  object.__setattr__(backbone, name, method)


def _record_layouts(strategy, kernel_path, variable_layouts):
  """Adds the factors' `VariableLayout`s to the layout holding the kernel
  at `kernel_path`, in every model of `strategy` that records it (what
  `describe` and later sharding read)."""
  replaced = {}
  for model in strategy.extended.registered_models():
    recorded = getattr(model, "_tfpar_layouts", None)
    if not recorded:
      continue
    updated = []
    for layout in recorded:
      if any(v.path == kernel_path for v in layout.variables):
        if id(layout) not in replaced:
          replaced[id(layout)] = dataclasses.replace(
              layout, variables=layout.variables + tuple(variable_layouts))
          object.__setattr__(layout.layer, "_tfpar_layer_layout",
                             replaced[id(layout)])
        layout = replaced[id(layout)]
      updated.append(layout)
    object.__setattr__(model, "_tfpar_layouts", tuple(updated))


def _late_enable_lora(layer, strategy, tensor_size, groups, placing):
  original = layer.enable_lora

  def placed():
    """(the layer's tensor groups, a new context creating its variables
    where its own live)."""
    if placing is None:
      return groups, contextlib.nullcontext()
    return placing(layer)

  def enable_lora(rank, *args, **kwargs):
    kernel = keras_layers.dense_kernel(layer)  # Whole if in view already.
    weight = kernel if isinstance(kernel, weights_lib.SpmdWeight) else (
        getattr(kernel, "_tfpar_shard_of", (None,))[0])
    _, where = placed()
    # Created whole on every device (the kernel seen whole: its shape).
    with strategy.scope(), spread.creating_in_place(), (
        weights_lib.whole_attributes([layer])), where:
      result = original(rank, *args, **kwargs)
    if weight is None:  # A replicated layer: its factors stay whole.
      return result
    shapes = (tuple(layer.lora_kernel_a.shape),
              tuple(layer.lora_kernel_b.shape))
    if shapes != (weight.shape[:-1] + (rank,), (rank, weight.shape[-1])):
      raise RuntimeError(
          f"Keras's enable_lora on layer {layer.name!r} made LoRA factors of "
          f"shapes {shapes} for its whole kernel {weight.shape}; tfpar "
          f"expects the kernel's leading axes plus {rank} and [{rank}, last "
          f"axis] (keras {keras.__version__}; a Keras upgrade changed it).")
    variable_layouts = lora.lora_layouts(
        layer, weight.axis, weight.layout.style,
        f"{weight.layout.source}; LoRA enabled after sharding")
    # Keras's order now (the frozen kernel after the factors), whole.
    order = getattr(layer, "_tfpar_logical_order")
    wholes = {id(item.variable): item for item in order
              if isinstance(item, weights_lib.SpmdWeight)}
    order[:] = [wholes.get(id(v), v)
                for v in keras_layers.own_variables(layer)]
    kind = layouts.DENSE if isinstance(layer, keras.layers.Dense) else (
        layouts.EINSUM)
    layer_groups, where = placed()
    with spread.creating_in_place(), where:
      weights_lib.split_layer(
          layouts.LayerLayout(layer, kind, weight.layout.style,
                              tuple(variable_layouts)),
          tensor_size, strategy, layer_groups)
    _record_layouts(strategy, weight.path, variable_layouts)
    return result

  object.__setattr__(layer, "enable_lora", enable_lora)

