"""`ShardingPlan`: declarative rules from Keras variable paths to styles."""

import re

from tfpar._compat import keras_layers
from tfpar.tensor_parallel import builtin
from tfpar.tensor_parallel import coverage as coverage_lib
from tfpar.tensor_parallel import styles


class ShardingPlan:
  """Ordered rules from Keras variable paths (regular expressions, matched
  with `re.search`) to sharding styles, plus built-in plans for the rest.

  Every rule must match at least one variable and no variable may match two
  rules. Layers no rule touches get the built-in plan (when `builtin=True`):
  attention split by heads (`keras.layers.MultiHeadAttention` and the
  keras-hub families GPT-2, BERT, Llama, Mistral, Qwen2 and Gemma, with
  grouped key/value heads split or shared), embedding tables split on the
  vocabulary, MLPs (projections whose outputs reach another projection
  through elementwise ops only, gated MLPs included, found by tracing the
  model) split column- then row-parallel, other `EinsumDense` layers
  column-parallel. Other layers are replicated, and a replicated weight
  larger than every split one is an error unless a `tfpar.Replicate()` rule
  names it.

  Args:
    rules: sequence of `(regex, style)` pairs; style is a
      `tfpar.ColumnParallel`, `tfpar.RowParallel`, `tfpar.VocabParallel` or
      `tfpar.Replicate` instance.
    builtin: apply the built-in plans to layers no rule touches.

  Raises:
    ValueError: a malformed rule.

  Example:

  >>> import keras, tfpar
  >>> inputs = keras.Input((8,))
  >>> hidden = keras.layers.Dense(16, activation="relu", name="up")(inputs)
  >>> model = keras.Model(inputs, keras.layers.Dense(8, name="down")(hidden))
  >>> plan = tfpar.ShardingPlan([(r"down/kernel", tfpar.RowParallel())])
  >>> [(l.path, l.style.name) for l in plan.resolve(model, 2)[0].variables]
  [('up/kernel', 'ColumnParallel'), ('up/bias', 'ColumnParallel')]
  """

  def __init__(self, rules=(), builtin=True):
    self._rules = []
    for index, rule in enumerate(rules):
      if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
        raise ValueError(
            f"ShardingPlan rule {index} must be a (regex, style) pair. "
            f"Received: {rule!r}")
      pattern, style = rule
      if not isinstance(style, styles.Style) or type(style) is styles.Style:
        raise ValueError(
            f"ShardingPlan rule {index} ({pattern!r}) needs a style "
            f"instance such as tfpar.ColumnParallel(). Received: {style!r}")
      try:
        compiled = re.compile(pattern)
      except (re.error, TypeError) as error:
        raise ValueError(
            f"ShardingPlan rule {index}: {pattern!r} is not a regular "
            f"expression ({error}).") from None
      self._rules.append((compiled, style))
    self._builtin = builtin

  @property
  def rules(self):
    """The `(pattern, style)` rules, in order."""
    return tuple((p.pattern, s) for p, s in self._rules)

  def _user_styles(self, model):
    """{variable path: (style, source)} from the rules, checked."""
    matches = {}
    hits = [0] * len(self._rules)
    for variable in model.weights:
      found = [(i, s) for i, (p, s) in enumerate(self._rules)
               if p.search(variable.path)]
      if len(found) > 1:
        raise ValueError(
            f"Variable {variable.path!r} matches {len(found)} ShardingPlan "
            f"rules: " + ", ".join(
                f"rule {i} {self._rules[i][0].pattern!r} -> {s}"
                for i, s in found) + ". Each variable may match one rule.")
      for i, style in found:
        hits[i] += 1
        matches[variable.path] = (
            style, f"rule {i} {self._rules[i][0].pattern!r}")
    for i, count in enumerate(hits):
      if not count:
        raise ValueError(
            f"ShardingPlan rule {i} {self._rules[i][0].pattern!r} -> "
            f"{self._rules[i][1]} matches no variable of model "
            f"{model.name!r}. Its variables are: "
            + ", ".join(v.path for v in model.weights))
    return matches

  def resolve(self, model, tensor_size, elsewhere=()):
    """The `LayerLayout` of every sharded layer of a built model.

    Args:
      model: a built Keras model (not yet sharded).
      tensor_size: the size of the mesh's `tensor` axis.
      elsewhere: paths of weights another parallelism splits (experts
        under expert x tensor): not replicated, so never refused as such.

    Returns:
      A tuple of `tfpar.tensor_parallel.layouts.LayerLayout`, one per layer
      with a sharded variable.

    Raises:
      ValueError: a rule matches no variable, a variable matches two rules,
        a style cannot apply to a layer, or a split dimension is not
        divisible by `tensor_size`.
    """
    if not model.built:
      raise ValueError(
          f"Model {model.name!r} is not built, so its variables are not "
          f"known yet. Build it first (keras.Input, model.build(shape) or "
          f"calling it once) inside strategy.scope().")
    user = self._user_styles(model)
    resolved = builtin.resolve_layers(model, user, tensor_size,
                                      use_builtin=self._builtin)
    claimed = {v.path for layout in resolved for v in layout.variables}
    for path, (style, source) in user.items():
      if path not in claimed and not isinstance(style, styles.Replicate):
        raise ValueError(
            f"{source} gives {path!r} the style {style}, but its layer is "
            f"not a Dense, EinsumDense, Embedding or MultiHeadAttention "
            f"layer (or keras-hub attention) tfpar can shard (it belongs to "
            f"{_owner_class(model, path)}). Only "
            f"tfpar.Replicate() applies to it.")
    if self._builtin:
      # Position tables kept whole by the built-in plan are a layout
      # chosen (Megatron's), not a weight it has no plan for.
      accepted = dict(user)
      accepted.update((v.path, (v.style, v.source)) for layout in resolved
                      for v in layout.variables
                      if v.source == builtin.POSITION_TABLE)
      coverage_lib.check_large_replicated(
          model, coverage_lib.coverage(
              ((v.path, v.shape) for v in model.weights), resolved,
              elsewhere), accepted,
          lambda path: _owner_class(model, path))
    return tuple(layout for layout in resolved if layout.is_sharded)

  def describe(self, model, strategy=None, print_fn=print):
    """Prints how every variable of `model` is laid out.

    One line per variable: its path, full shape, style, shard shape and the
    devices holding each shard.

    Args:
      model: a built Keras model.
      strategy: the `tfpar.TensorParallelStrategy`; default: the strategy
        the model was created under.
      print_fn: where the lines go; None to only return the text.

    Returns:
      The text.

    Example:

    >>> import keras, tfpar
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(8, name="down")(x))
    >>> text = tfpar.ShardingPlan().describe(
    ...     model, tfpar.TensorParallelStrategy(tfpar.Mesh({"tensor": 2})),
    ...     print_fn=lambda s: None)  # doctest: +SKIP
    """
    from tfpar.tensor_parallel import describe as describe_lib  # pylint: disable=g-import-not-at-top
    text = describe_lib.describe(self, model, strategy)
    if print_fn is not None:
      print_fn(text)
    return text

  def __repr__(self):
    rules = ", ".join(f"({p!r}, {s})" for p, s in self.rules)
    return f"ShardingPlan([{rules}], builtin={self._builtin})"


def _owner_class(model, path):
  """'layer name (class)' of the layer that owns the variable at `path`."""
  for layer in keras_layers.flatten_layers(model, include_self=False):
    if any(v.path == path for v in keras_layers.own_variables(layer)):
      return f"layer {layer.name!r} ({type(layer).__name__})"
  return "an unknown layer"


def as_plan(plan):
  """`plan` as a `ShardingPlan` (None gives the built-in plan)."""
  if plan is None:
    return ShardingPlan()
  if isinstance(plan, ShardingPlan):
    return plan
  if isinstance(plan, (list, tuple)):
    return ShardingPlan(plan)
  raise ValueError(
      f"plan must be a tfpar.ShardingPlan, a list of (regex, style) rules or "
      f"None. Received: {plan!r}")

