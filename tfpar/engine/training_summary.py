"""One line naming a model's dtype policy and gradient accumulation, for
every strategy's `describe()` (the recipes' describe names the same)."""


def _policy_names(model):
  """Dtype policy names of the model, its layers that hold weights and
  those of nested models (through the public `layers`)."""
  names = {model.dtype_policy.name}
  for layer in getattr(model, "layers", ()):
    if getattr(layer, "layers", None):
      names.update(_policy_names(layer))
    elif layer.weights:
      names.add(layer.dtype_policy.name)
  return sorted(names)


def training_line(model):
  """"training: <policy>; <accumulation>" for `model`.

  The policy is Keras's (with its variable and compute dtypes, and dynamic
  loss scaling when the compiled optimizer is a `LossScaleOptimizer`);
  accumulation is the compiled optimizer's `gradient_accumulation_steps`.

  Args:
    model: a Keras model, compiled or not.

  Returns:
    The line, without a newline.

  Example:

  >>> import keras
  >>> from tfpar.engine.training_summary import training_line
  >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  >>> model.compile(keras.optimizers.SGD(gradient_accumulation_steps=4),
  ...               "mse")
  >>> training_line(model)
  'training: policy float32; gradient accumulation over 4 steps'
  """
  import keras  # pylint: disable=g-import-not-at-top
  parts = []
  for name in _policy_names(model):
    policy = keras.dtype_policies.get(name)
    if policy.variable_dtype != policy.compute_dtype:
      parts.append(f"{name} (variables {policy.variable_dtype}, compute "
                   f"{policy.compute_dtype})")
    else:
      parts.append(name)
  text = f"training: policy {', '.join(parts)}"
  optimizer = getattr(model, "optimizer", None)
  if optimizer is None:
    return text + "; not compiled"
  inner = getattr(optimizer, "inner_optimizer", None)
  if inner is not None:
    text += "; dynamic loss scaling"
  steps = getattr(inner or optimizer, "gradient_accumulation_steps", None)
  if steps:
    return text + f"; gradient accumulation over {steps} steps"
  return text + "; no gradient accumulation"
