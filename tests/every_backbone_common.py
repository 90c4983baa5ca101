"""Every text backbone of the installed keras-hub, built from small
arguments read off its constructor, in its task model, for
tests/test_keras_hub_every_backbone.py (random init, nothing downloaded).

A text backbone is a `keras_hub.models.Backbone` subclass whose
constructor takes a vocabulary size (a parameter named with "vocab":
`vocabulary_size`, `vocab_size`, `text_vocab_size`). A family a keras-hub
upgrade adds is found by that rule and built by `small_arguments`, with no
code change.
"""

import inspect

import keras
import keras_hub
import numpy as np

import one_device_optimizer
import tfpar
from tfpar._compat import keras_layers

VOCAB = 64
SEQUENCE = 8
BATCH = 4
STEPS = 4
CLASSES = 2
LEARNING_RATE = 0.1
MASKS = 2  # Masked positions per example for a MaskedLM.
LAYOUT = {"data": 2, "tensor": 2}
M = keras_hub.models

# The one place of per-family arguments: constructor arguments that the
# generic names below cannot supply (layer-type lists, image sizes,
# experts) or whose defaults do not fit the small sizes.
CONFIGS = {
    "SmolLM3Backbone": dict(
        attention_bias=False, rope_layer_enabled_list=[True],
        layer_types=["attention"], mlp_bias=False, layer_norm_epsilon=1e-6,
        rope_theta=10000.0, partial_rotary_factor=1.0),
    "Gemma3Backbone": dict(image_size=16, vision_encoder=None),
    "Gemma4Backbone": dict(image_size=16, vision_encoder=None),
    "MixtralBackbone": dict(num_experts=4, top_k=2),
    "QwenMoeBackbone": dict(num_experts=4, top_k=2,
                            shared_expert_intermediate_dim=16),
    "Qwen3MoeBackbone": dict(num_experts=4, top_k=2),
    "GptOssBackbone": dict(num_experts=4, top_k=2),
    "Qwen3_5Backbone": dict(layer_types=["full_attention"]),
    "Gemma3nBackbone": dict(
        pad_token_id=0, hidden_activation="gelu_approximate",
        layer_types=["full_attention"], sliding_window=8, rope_theta=1e4,
        hidden_size_per_layer_input=8, altup_num_inputs=2, laurel_rank=4,
        intermediate_size=[64]),
    "PaliGemmaBackbone": dict(image_size=16, vit_patch_size=4),
    "T5GemmaBackbone": dict(encoder_layer_types=["full_attention"],
                            decoder_layer_types=["full_attention"]),
    "T5Gemma2Backbone": dict(encoder_layer_types=["full_attention"],
                             decoder_layer_types=["full_attention"]),
    "MoonshineBackbone": dict(filter_dim=32),
    "Qwen3_5MoeBackbone": dict(num_experts=4, top_k=2,
                               shared_expert_intermediate_size=16,
                               layer_types=["full_attention"]),
}


def text_backbones():
  """{class name: class} of every text backbone in `keras_hub.models`
  (aliases such as `Qwen2Backbone` counted once, under the class's own
  name)."""
  found = {}
  for name in dir(M):
    cls = getattr(M, name)
    if (inspect.isclass(cls) and issubclass(cls, M.Backbone) and
        cls is not M.Backbone and any(
            "vocab" in p for p in inspect.signature(cls).parameters)):
      found[cls.__name__] = cls
  return dict(sorted(found.items()))


def _small_value(name):
  """A tiny value for a constructor argument, by its name, or None."""
  rules = (
      (lambda n: "vocab" in n, VOCAB),
      (lambda n: "dropout" in n, 0.0),
      (lambda n: "key_value_heads" in n, 2),
      (lambda n: n.endswith("heads"), 4),
      # Not counts of layers sharing something (num_kv_shared_layers).
      (lambda n: "num" in n and "layers" in n and "shared" not in n, 1),
      (lambda n: n.endswith(("intermediate_dim", "intermediate_size",
                             "mlp_dim", "ffn_dim")), 64),
      (lambda n: n.endswith(("head_dim", "head_size")), 8),
      (lambda n: n.endswith(("hidden_dim", "hidden_size", "embedding_dim")),
       32),
      (lambda n: n.startswith("max_") and n.endswith(
          ("sequence_length", "position_embeddings")), SEQUENCE),
  )
  for accepts, value in rules:
    if accepts(name):
      return value
  return None


def small_arguments(cls):
  """Constructor arguments for a 1-block, hidden-32 model of `cls`: every
  parameter named like a size gets a tiny value, dropout 0, then
  `CONFIGS`.

  Args:
    cls: a text backbone class.

  Returns:
    A dict of keyword arguments.

  Raises:
    ValueError: a required parameter has no small value (the family needs
      an entry in `CONFIGS`).
  """
  arguments = {}
  for name, parameter in inspect.signature(cls).parameters.items():
    if parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
      continue
    value = _small_value(name)
    if value is not None:
      arguments[name] = value
  arguments.update(CONFIGS.get(cls.__name__, {}))
  missing = [n for n, p in inspect.signature(cls).parameters.items()
             if p.default is p.empty and n not in arguments and
             p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
  if missing:
    raise ValueError(
        f"{cls.__name__} requires {missing}, which no generic small value "
        f"covers: give it an entry in CONFIGS.")
  return arguments


_TASK_KINDS = ("CausalLM", "TextClassifier", "MaskedLM")  # Preferred first.


def task_class(backbone_cls):
  """The task model keras-hub has for `backbone_cls` (a CausalLM, which
  includes Seq2SeqLM, else a TextClassifier, else a MaskedLM), or None."""
  tasks = [getattr(M, n) for n in sorted(dir(M), key=len)]
  tasks = [t for t in tasks if inspect.isclass(t) and issubclass(t, M.Task)
           and getattr(t, "backbone_cls", None) is backbone_cls]
  for kind in _TASK_KINDS:
    for task in tasks:
      if issubclass(task, getattr(M, kind)):
        return task
  return None


def _sequence_output(backbone):
  """The backbone's per-token output (a decoder's, for encoder-decoders)."""
  output = backbone.output
  if not isinstance(output, dict):
    return output
  names = sorted(output, key=lambda n: ("decoder" not in n,
                                        "sequence" not in n))
  return output[names[0]]


def build(backbone_cls):
  """The family's task model around a small backbone, or, where keras-hub
  has none, the backbone with a next-token head: its token embedding
  reversed when it can be (as keras-hub's CausalLMs do), else a Dense.

  Args:
    backbone_cls: a text backbone class.

  Returns:
    A Keras model whose inputs are a dict of named tensors.
  """
  backbone = backbone_cls(**small_arguments(backbone_cls))
  task = task_class(backbone_cls)
  if task is None:
    hidden = _sequence_output(backbone)
    table = getattr(backbone, "token_embedding", None)
    if table is not None and "reverse" in inspect.signature(
        table.call).parameters:
      logits = table(hidden, reverse=True)
    else:
      logits = keras.layers.Dense(VOCAB, name="next_token_head")(hidden)
    model = keras.Model(backbone.input, logits)
  else:
    parameters = inspect.signature(task).parameters
    extra = {name: value for name, value in (("num_classes", CLASSES),
                                              ("dropout", 0.0))
             if name in parameters}
    model = task(backbone=backbone, preprocessor=None, **extra)
  model.projection_kernel_paths = tuple(
      layer.kernel.path
      for layer in keras_layers.flatten_layers(backbone)
      if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)))
  model.backbone_weight_paths = tuple(w.path for w in backbone.weights)
  # Token tables: embeddings with one row per vocabulary entry.
  model.token_table_paths = tuple(
      w.path for layer in keras_layers.flatten_layers(backbone)
      if isinstance(layer, keras.layers.Embedding) and
      layer.input_dim == VOCAB for w in layer.weights)
  return model


def data(model, count=BATCH * STEPS, seed=0):
  """(inputs, integer targets) for `model`, generated from its input names
  and its output's rank: token ids, padding masks (the last position
  sometimes padded), segment ids, masked positions, float features."""
  rng = np.random.default_rng(seed)
  inputs = {}
  for name, spec in model.input.items():
    shape = (count,) + tuple(
        (MASKS if "mask_positions" in name else SEQUENCE) if d is None else d
        for d in spec.shape[1:])
    if "padding_mask" in name:
      value = np.ones(shape, "int32")
      value[:, -1] = rng.integers(0, 2, count)
    elif "segment_ids" in name:
      value = np.zeros(shape, "int32")
    elif "mask_positions" in name:
      value = rng.integers(0, SEQUENCE, shape)
    elif "int" in str(spec.dtype):
      value = rng.integers(1, VOCAB, shape)
    else:
      value = rng.normal(size=shape)
    inputs[name] = value.astype(spec.dtype)
  output = model.output
  if len(output.shape) == 3:
    length = MASKS if "mask_positions" in inputs else SEQUENCE
    targets = rng.integers(1, VOCAB, (count, length))
  else:
    targets = rng.integers(0, output.shape[-1], count)
  return inputs, targets.astype("int32")


def sharded(backbone_cls):
  """(the family's model created under data 2 x tensor 2, its strategy),
  seeded as `reference` is."""
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh(LAYOUT))
  with strategy.scope():
    keras.utils.set_random_seed(1)
    model = build(backbone_cls)
    _compile(model)
  return model, strategy


def reference(backbone_cls):
  """The family's model on one device."""
  keras.utils.set_random_seed(1)
  model = build(backbone_cls)
  _compile(model)
  return model


def _compile(model):
  model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))


def train_both(one_device, distributed):
  """Fits both models on the same batches (STEPS SGD steps) and returns
  the largest difference between their weights."""
  x, y = data(one_device)
  one_device_optimizer.build(one_device)
  for model in (one_device, distributed):
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  expected, got = one_device.get_weights(), distributed.get_weights()
  assert [w.shape for w in got] == [w.shape for w in expected]
  return max(float(np.abs(a - b).max()) for a, b in zip(got, expected))


def megatron_share(model, whole=()):
  """Bytes one device holds under Megatron's layout at tensor 2, counted
  from the one-device model's weights: the kernel of every projection
  (Dense, EinsumDense) of the backbone and the token tables halved;
  norms, biases, position and segment tables, convolutions and the task
  model's own head (Megatron-LM keeps its classification and LM heads
  whole) whole.

  Args:
    model: a model from `build`, on one device.
    whole: paths of weights counted whole although the rule halves them.

  Returns:
    The bytes, a float.
  """
  halves = set(model.token_table_paths) | set(model.projection_kernel_paths)
  share = 0
  for weight in model.weights:
    size = int(np.prod(weight.shape)) * np.dtype(weight.dtype).itemsize
    halved = weight.path in halves and weight.path not in whole
    share += size / 2 if halved else size
  return share


def nudged_difference(backbone_cls, size=1e-7):
  """How far one device's own rounding can carry training: the largest
  weight difference, after the same steps, between two one-device runs
  whose initial weights differ by `size` (added to every weight)."""
  first, second = reference(backbone_cls), reference(backbone_cls)
  second.set_weights([w + np.asarray(size, w.dtype)
                      for w in second.get_weights()])
  return train_both(first, second)
