"""Resolving a model's layers to layouts: user rules, then built-in plans."""

import keras

from tfpar._compat import keras_attention
from tfpar._compat import keras_layers
from tfpar.tensor_parallel import families
from tfpar.tensor_parallel import layouts
from tfpar.tensor_parallel import lora
from tfpar.tensor_parallel import structure
from tfpar.tensor_parallel import styles
from tfpar.tensor_parallel import traced_attention



def _is_attention(layer):
  return type(layer) is keras.layers.MultiHeadAttention


def attention_parts(layer):
  """{role: EinsumDense} of a built MultiHeadAttention."""
  return keras_attention.projections(layer)


def _kernel(layer):
  """The kernel variable of a Dense or EinsumDense (`layer.kernel` is a
  tensor, not the variable, when LoRA is enabled)."""
  return next(w for w in layer.weights if w.name == "kernel")


def _check_divisible(what, size, tensor_size, layer):
  if size % tensor_size:
    raise ValueError(
        f"Layer {layer.name!r}: {what} = {size} is not divisible by the "
        f"mesh's tensor size {tensor_size}, so it cannot be split evenly "
        f"over the tensor axis. Choose a tensor size that divides {size} or "
        f"give the layer tfpar.Replicate().")


def _variable(var, style, axis, source):
  return layouts.VariableLayout(var.path, tuple(var.shape), style, axis,
                                source)


def _projection_layout(layer, kind, style, source, tensor_size):
  """Layout of a Dense or EinsumDense under COLUMN / ROW / REPLICATE."""
  if isinstance(style, styles.Replicate):
    return layouts.LayerLayout(layer, kind, style, tuple(
        _variable(v, style, None, source) for v in layer.weights))
  lora.check_quantization(layer, style, source)
  kernel, bias = _kernel(layer), layer.bias
  letter = None
  if kind == layouts.DENSE:
    kernel_axis = 1 if isinstance(style, styles.ColumnParallel) else 0
    bias_axis = 0
  else:
    letter = layouts.einsum_split_letter(layer.equation, style)
    if letter is None:
      raise ValueError(
          f"Layer {layer.name!r} (equation {layer.equation!r}) has no "
          f"{'output-only' if isinstance(style, styles.ColumnParallel) else 'contracted'}"
          f" kernel axis for {style}.")
    _, kernel_letters, output = layouts.einsum_letters(layer.equation)
    kernel_axis = kernel_letters.index(letter)
    bias_axis = None
    if bias is not None and letter in (layer.bias_axes or ""):
      bias_axis = len(bias.shape) + output.index(letter) - len(output)
  _check_divisible(
      f"kernel axis {kernel_axis} ({'output' if isinstance(style, styles.ColumnParallel) else 'input'} features)",
      kernel.shape[kernel_axis], tensor_size, layer)
  variables = [_variable(kernel, style, kernel_axis, source)]
  if bias is not None:
    split_bias = isinstance(style, styles.ColumnParallel) and (
        bias_axis is not None)
    variables.append(_variable(bias, style if split_bias else styles.REPLICATE,
                               bias_axis if split_bias else None, source))
  variables.extend(lora.extra_layouts(layer, kernel, kernel_axis, style,
                                      source))
  return layouts.LayerLayout(layer, kind, style, tuple(variables), letter)


def _user_layer_style(layer, user, expected):
  """The layer style its user rules imply, or None if no rule touches it.

  `expected` maps each variable path to the style it must have for the
  layer to be sharded; all-Replicate rules replicate the layer.
  """
  given = {path: user[path] for path in expected if path in user}
  if not given:
    return None
  if all(isinstance(s, styles.Replicate) for s, _ in given.values()):
    return styles.REPLICATE, next(iter(given.values()))[1]
  for path, (style, source) in given.items():
    if style != expected[path] and not (
        isinstance(style, styles.Replicate) and
        isinstance(expected[path], styles.Replicate)):
      raise ValueError(
          f"{source} gives {path!r} the style {style}, which does not fit "
          f"layer {layer.name!r}: its variables must be "
          + ", ".join(f"{p} -> {s}" for p, s in expected.items())
          + " (or all tfpar.Replicate()).")
  return None, next(iter(given.values()))[1]


def _resolve_attention(layer, family, user, tensor_size, use_builtin):
  """Attention split by heads: keras.layers.MultiHeadAttention with tfpar's
  own call (family None), a registered or traced family with its own call
  run per device (`spmd/layers._install_heads`)."""
  parts = (family.projections(layer) if family is not None
           else attention_parts(layer))
  kind = layouts.ATTENTION if family is None else layouts.HEADS
  expected = {}
  for role, dense in parts.items():
    kernel_style = styles.ROW if role == "output" else styles.COLUMN
    expected[_kernel(dense).path] = kernel_style
    if dense.bias is not None:
      expected[dense.bias.path] = (styles.REPLICATE if role == "output"
                                   else styles.COLUMN)
  decided = _user_layer_style(layer, user, expected)
  if decided is None and not use_builtin:
    decided = (styles.REPLICATE, "no rule (built-in plans off)")
  if decided is not None and decided[0] == styles.REPLICATE:
    return [layouts.LayerLayout(layer, kind, styles.REPLICATE,
                                tuple(_variable(v, styles.REPLICATE, None,
                                                decided[1])
                                      for v in layer.weights))]
  source = decided[1] if decided else "built-in: attention split by heads"

  def project_layout(dense, style):
    dense_kind = (layouts.DENSE if type(dense) is keras.layers.Dense
                  else layouts.EINSUM)
    return _projection_layout(dense, dense_kind, style, source, tensor_size)

  if family is not None:
    family.head_local_weights(layer)  # Refuses weights it cannot place.
    return [layouts.LayerLayout(layer, kind, styles.COLUMN,
                                families.resolved_variables(
                                    layer, family, tensor_size, source,
                                    project_layout))]
  _check_divisible("num_heads", layer.num_heads, tensor_size, layer)
  variables = []
  for role, dense in parts.items():
    style = styles.ROW if role == "output" else styles.COLUMN
    variables.extend(project_layout(dense, style).variables)
  return [layouts.LayerLayout(layer, kind, styles.COLUMN, tuple(variables))]


def _resolve_projection(layer, kind, user, tensor_size, builtin_style,
                        builtin_source):
  expected_by_style = {}
  for style in (styles.COLUMN, styles.ROW):
    expected = {_kernel(layer).path: style}
    if layer.bias is not None:
      expected[layer.bias.path] = style
    expected_by_style[style] = expected
  given = {p: user[p] for p in (v.path for v in layer.weights) if p in user}
  if given:
    kernel = given.get(_kernel(layer).path)
    if kernel is None:
      path, (style, source) = next(iter(given.items()))
      if not isinstance(style, styles.Replicate):
        raise ValueError(
            f"{source} gives {path!r} the style {style} but no rule covers "
            f"{_kernel(layer).path!r}: a bias follows its kernel, so give the "
            f"style to the kernel.")
      return _projection_layout(layer, kind, styles.REPLICATE, source,
                                tensor_size)
    style, source = kernel
    if isinstance(style, styles.VocabParallel):
      raise ValueError(f"{source}: VocabParallel applies to Embedding "
                       f"tables, not to {kind} kernel {_kernel(layer).path!r}.")
    if layer.bias is not None and layer.bias.path in given:
      bias_style, bias_source = given[layer.bias.path]
      if bias_style != style:
        raise ValueError(
            f"{bias_source} gives {layer.bias.path!r} the style {bias_style} "
            f"but its kernel is {style}: a bias follows its kernel.")
    return _projection_layout(layer, kind, style, source, tensor_size)
  return _projection_layout(layer, kind, builtin_style, builtin_source,
                            tensor_size)


def _is_embedding(layer):
  """Embedding tables tfpar splits on the vocabulary: keras.layers.Embedding
  and keras.layers.ReversibleEmbedding (keras-hub's token embeddings)."""
  return type(layer) is keras.layers.Embedding or isinstance(
      layer, keras.layers.ReversibleEmbedding)


# The source of position tables kept whole (Megatron's layout; the
# coverage check accepts them, `plan.py`).
POSITION_TABLE = "built-in: position table (ids not computed from the inputs)"


def _resolve_embedding(layer, user, tensor_size, use_builtin,
                       positions=False):
  table = keras_layers.embeddings(layer)  # The variable (LoRA: a tensor).
  if table.path in user:
    style, source = user[table.path]
  elif use_builtin and positions:
    # Ids not computed from the model's inputs: a position table (ViT's,
    # SigLIP's), whole on every device as Megatron keeps it.
    style, source = styles.REPLICATE, POSITION_TABLE
  elif use_builtin and layer.input_dim < tensor_size:
    # Fewer rows than devices (BERT's 2 segment types): nothing to split.
    style, source = styles.REPLICATE, (
        f"built-in: {layer.input_dim} rows, fewer than tensor {tensor_size}")
  elif use_builtin:
    style, source = styles.VOCAB, "built-in: embedding split on vocabulary"
  else:
    style, source = styles.REPLICATE, "no rule (built-in plans off)"
  # A ReversibleEmbedding's untied output table [hidden, vocabulary].
  reverse = getattr(layer, "reverse_embeddings", None)
  tables = [(table, 0)] + ([(reverse, 1)] if reverse is not None else [])
  if isinstance(style, styles.Replicate):
    return layouts.LayerLayout(layer, layouts.EMBEDDING, style, tuple(
        _variable(v, style, None, source) for v in layer.weights))
  if not isinstance(style, styles.VocabParallel):
    raise ValueError(f"{source} gives embedding table {table.path!r} the "
                     f"style {style}; tables take tfpar.VocabParallel() or "
                     f"tfpar.Replicate().")
  if getattr(layer, "lora_enabled", False):
    raise ValueError(
        f"Layer {layer.name!r} ({type(layer).__name__}) has LoRA enabled "
        f"({source} gives it {style}); tensor parallelism splits the LoRA "
        f"of Dense and EinsumDense layers only. Enable LoRA on those "
        f"(keras-hub's backbone.enable_lora targets the attention "
        f"projections), or give the embedding's weights tfpar.Replicate().")
  lora.check_quantization(layer, style, source)
  if getattr(layer, "quantization_mode", None) == "int8":  # Row scales.
    tables.append((layer.embeddings_scale, 0))
    if reverse is not None:
      tables.append((layer.reverse_embeddings_scale, 0))
  _check_divisible("input_dim (vocabulary)", layer.input_dim, tensor_size,
                   layer)
  return layouts.LayerLayout(layer, layouts.EMBEDDING, style, tuple(
      _variable(v, style, axis, source) for v, axis in tables))


def resolve_layers(model, user, tensor_size, use_builtin=True):
  """`LayerLayout`s of every Dense, EinsumDense, Embedding and attention
  layer of `model` (sharded or not).

  Attention layers (keras.layers.MultiHeadAttention, the families of
  `families.py`, and any layer whose attention tracing the model finds,
  `attention_trace.py`) are split by heads; the MLPs tracing the model
  finds (`structure.py`) column- then row-parallel; other EinsumDense
  layers column-parallel; other Dense layers are replicated.
  """
  inside_attention = set()
  resolved = []
  projections = []
  embeddings = []
  handled = set()
  for layer in keras_layers.flatten_layers(model, include_self=False, recursive=True):
    if layer in inside_attention or not layer.built:
      continue
    family = families.table_family_of(layer)
    if _is_attention(layer) or family is not None:
      inside = list(keras_layers.flatten_layers(layer, include_self=False))
      inside_attention.update(inside)
      handled.add(layer)
      handled.update(inside)
      resolved.extend(_resolve_attention(layer, family, user, tensor_size,
                                         use_builtin))
    elif _is_embedding(layer):
      embeddings.append(layer)
    elif type(layer) in (keras.layers.EinsumDense, keras.layers.Dense):
      projections.append(layer)
  calls = None
  if use_builtin and (projections or embeddings):
    traced, projections, calls = traced_attention.resolve(
        model, projections, embeddings, handled, user, tensor_size,
        _resolve_attention)
    resolved.extend(traced)
  for layer in embeddings:
    positions = (type(layer) is keras.layers.Embedding and calls is not None
                 and structure.reads_model_inputs(calls, layer) is False)
    resolved.append(_resolve_embedding(layer, user, tensor_size,
                                       use_builtin, positions))
  pairs = (structure.mlp_styles(model, projections, calls)
           if use_builtin else {})
  for layer in projections:
    dense = type(layer) is keras.layers.Dense
    if layer in pairs:
      style, source = pairs[layer], f"built-in: MLP ({pairs[layer]})"
    elif not use_builtin:
      style, source = styles.REPLICATE, "no rule"
    elif dense:
      style, source = styles.REPLICATE, "built-in: lone Dense is replicated"
    else:
      style, source = styles.COLUMN, "built-in: standalone EinsumDense"
    resolved.append(_resolve_projection(
        layer, layouts.DENSE if dense else layouts.EINSUM, user, tensor_size,
        style, source))
  return resolved
