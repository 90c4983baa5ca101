"""keras-hub's `CausalLM.generate` under tfpar's strategies gives one
device's tokens; under tensor parallelism each device's key/value cache
holds only its heads.

Models: GPT2CausalLM (4 heads), LlamaCausalLM (4 query heads, 2 key/value
heads) and MixtralCausalLM from small configs, random init with one seed,
prompts of 4 tokens padded to 12. Greedy and seeded top-k samplers.

Cache bytes are counted by a hook on the model class's own
`call_with_cache`, which every device's trace calls: the shape, dtype and
device of each cache it returns. That the whole cache keras-hub's
`_build_cache` makes is never computed is read from the traced function's
graph: nothing consumes it (TensorFlow prunes a stateless op no output
needs from the function it runs).
"""

import collections
import contextlib
import functools
import re
import warnings

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import suite_scope
import tfpar

VOCAB, PROMPT, LENGTH, BATCH = 64, 4, 12, 4
_DECODER = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=32,
                intermediate_dim=64)


def _gpt2(preprocessor=None):
  vocabulary = (preprocessor.tokenizer.vocabulary_size() if preprocessor
                else VOCAB)
  backbone = keras_hub.models.GPT2Backbone(
      **dict(_DECODER, vocabulary_size=vocabulary), num_heads=4,
      max_sequence_length=16, dropout=0.0)
  return keras_hub.models.GPT2CausalLM(backbone, preprocessor)


def _causal_lm(name, **config):
  """`keras_hub.models.<name>CausalLM` on its backbone, no preprocessor."""
  backbone = getattr(keras_hub.models, f"{name}Backbone")(**_DECODER, **config)
  return getattr(keras_hub.models, f"{name}CausalLM")(backbone, None)


_GQA = dict(num_query_heads=4, num_key_value_heads=2)
_llama = lambda: _causal_lm("Llama", **_GQA)
_mixtral = lambda: _causal_lm("Mixtral", **_GQA, num_experts=4, top_k=2,
                              router_jitter_noise=0.0)


SAMPLERS = {"greedy": lambda: "greedy",
            "top_k": lambda: keras_hub.samplers.TopKSampler(k=5, seed=7)}


def _prompts():
  rng = np.random.default_rng(0)
  ids = rng.integers(1, VOCAB, size=(BATCH, LENGTH)).astype("int32")
  mask = np.zeros((BATCH, LENGTH), bool)
  mask[:, :PROMPT] = True
  return {"token_ids": ids * mask, "padding_mask": mask}


def _model(build, sampler, strategy=None):
  keras.utils.set_random_seed(3)
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = build()
    model.compile(sampler=SAMPLERS[sampler]())
  return model


def _generate(model, inputs=None, **kwargs):
  kwargs.setdefault("stop_token_ids", None)
  return model.generate(_prompts() if inputs is None else inputs, **kwargs)


_CLASSES = {_gpt2: keras_hub.models.GPT2CausalLM,
            _llama: keras_hub.models.LlamaCausalLM,
            _mixtral: keras_hub.models.MixtralCausalLM}


@functools.lru_cache(maxsize=None)
def _one_device(build, sampler):
  """One device's generate from a fresh `build()` model, computed once
  for every test that compares against it.

  Returns:
    A dict: "model"; "first" and "second", the outputs of its first and
    second `generate`; "caches", what `_caches` recorded of the first;
    "sampler", its sampler's variables after the second.
  """
  model = _model(build, sampler)
  with _caches(_CLASSES[build]) as caches:
    first = _generate(model)
  second = _generate(model)
  return {"model": model, "first": first, "second": second,
          "caches": caches,
          "sampler": [v.numpy() for v in model.sampler.variables]}


@contextlib.contextmanager
def _caches(model_class):
  """Records (device, shape, bytes) of every cache `model_class`'s
  `call_with_cache` returns, and the graph of its first call."""
  original = model_class.call_with_cache
  seen = {"caches": [], "graph": None}

  @functools.wraps(original)
  def call_with_cache(self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    cache = result[-1]
    seen["caches"].append((tf.DeviceSpec.from_string(cache.device).to_string(),
                           tuple(cache.shape),
                           int(np.prod(cache.shape)) * cache.dtype.size))
    if seen["graph"] is None:
      seen["graph"] = tf.compat.v1.get_default_graph()
    return result

  model_class.call_with_cache = call_with_cache
  try:
    yield seen
  finally:
    model_class.call_with_cache = original


def _bytes_per_device(seen):
  found = collections.defaultdict(int)
  for device, _, nbytes in seen["caches"]:
    found[device] = max(found[device], nbytes)
  return dict(found)


def _whole_cache_uses(graph, shape):
  """(tensors of `graph` of the whole cache's `shape`, ops reading them)."""
  whole = [output for op in graph.get_operations() for output in op.outputs
           if tuple(output.shape) == shape]
  return whole, [c.name for output in whole for c in output.consumers()]


def _check_split_cache(model_class, seen, reference, devices, share):
  """Each of `devices` carried `share` of one device's cache, and the
  whole cache was never used."""
  (_, whole_shape, whole_bytes), = set(reference["caches"])
  held = _bytes_per_device(seen)
  assert sorted(held) == sorted(devices), held
  assert all(b == whole_bytes * share for b in held.values()), (
      model_class.__name__, held, whole_bytes)
  # keras-hub's zeros of the whole cache are traced, and nothing reads them.
  whole, readers = _whole_cache_uses(seen["graph"], whole_shape)
  assert whole and not readers, (whole, readers)
  return held, whole_bytes


def _devices(count):
  return [tf.DeviceSpec.from_string(d).to_string()
          for d in tfpar.Mesh().devices[:count]]


def test_gpt2_tokens_and_cache_under_data2_tensor2():
  strategy = tfpar.TensorParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2}))
  for sampler in ("greedy", "top_k"):
    single = _one_device(_gpt2, sampler)
    reference, expected = single["caches"], single["first"]
    model = _model(_gpt2, sampler, strategy)
    with _caches(keras_hub.models.GPT2CausalLM) as seen:
      got = _generate(model)
    np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])
    np.testing.assert_array_equal(got["padding_mask"],
                                  expected["padding_mask"])
    # Again (the same function): the sampler's seed moved on alike.
    np.testing.assert_array_equal(_generate(model)["token_ids"],
                                  single["second"]["token_ids"])
    # The sampler ran once per token, as on one device.
    assert len(model.sampler.variables) == len(single["sampler"])
    for ours, theirs in zip(model.sampler.variables, single["sampler"]):
      np.testing.assert_array_equal(ours.numpy(), theirs)
    # 4 heads over 2 devices: each of the 4 devices holds 2 heads' cache.
    _check_split_cache(keras_hub.models.GPT2CausalLM, seen, reference,
                       _devices(4), 1 / 2)
  assert not (expected["token_ids"][:, PROMPT:] == 0).all()


def test_llama_shared_key_value_heads_under_tensor4():
  """2 key/value heads over 4 devices: each pair of devices shares one,
  so each device's cache is half of one device's."""
  strategy = tfpar.TensorParallelStrategy(tfpar.Mesh({"data": 1, "tensor": 4}))
  single = _one_device(_llama, "top_k")
  reference, expected = single["caches"], single["first"]
  with _caches(keras_hub.models.LlamaCausalLM) as seen:
    got = _generate(_model(_llama, "top_k", strategy))
  np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])
  _check_split_cache(keras_hub.models.LlamaCausalLM, seen, reference,
                     _devices(4), 1 / 2)


def test_llama_under_keras_distribution_layouts():
  """Keras's guide flow: keras-hub's layout map, set_distribution, no
  scope. keras-hub's generate lays its inputs out over the batch axis,
  which tfpar leaves to the strategy without a warning. The layout map
  also spreads weights over the batch axis: the strategy's ZeRO-3, so
  generate runs from 1/4 of the weights per device."""
  expected = _one_device(_llama, "top_k")["first"]
  mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
  distribution = keras.distribution.ModelParallel(
      layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh),
      batch_dim_name="batch")
  keras.distribution.set_distribution(distribution)
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings("error", message="keras.distribution")
      got = _generate(_model(_llama, "top_k"))
  finally:
    keras.distribution.set_distribution(None)
  np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])


# The other families tfpar splits by heads (TFPAR_TEST_FULL=1): each gave
# one device's tokens when measured (docs/tensor_parallel_spmd.md).
# Gemma has one key/value head (multi-query attention).
OTHER_FAMILIES = suite_scope.cases([], [
    ("Gemma", dict(num_query_heads=4, num_key_value_heads=1, head_dim=8),
     (2, 2)),
    ("Gemma", dict(num_query_heads=4, num_key_value_heads=1, head_dim=8),
     (1, 4)),
    ("Mistral", _GQA, (2, 2)), ("Qwen", _GQA, (2, 2))])


@pytest.mark.parametrize("family, config, mesh", OTHER_FAMILIES, ids=[
    f"{f}-{m[0]}x{m[1]}" for f, _, m in OTHER_FAMILIES])
def test_other_families(family, config, mesh):
  build = lambda: _causal_lm(family, **config)
  mesh = {"data": mesh[0], "tensor": mesh[1]}
  expected = _generate(_model(build, "top_k"))
  got = _generate(_model(build, "top_k", tfpar.TensorParallelStrategy(
      tfpar.Mesh(mesh))))
  np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])


def _preprocessor():
  # GPT-2's byte-level alphabet writes a space as "\u0120".
  letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
  tokens = ["<|endoftext|>", "\u0120"] + letters + ["th", "\u0120t"]
  tokenizer = keras_hub.models.GPT2Tokenizer(
      vocabulary={t: i for i, t in enumerate(tokens)},
      merges=["t h", "\u0120 t"])
  return keras_hub.models.GPT2CausalLMPreprocessor(tokenizer,
                                                   sequence_length=LENGTH)


def _fit_then_generate(prompts, strategy=None):
  """keras-hub's flow: fit on strings through the preprocessor, then
  generate from string prompts."""
  texts = ["the cat sat on a mat", "birds fly over green trees",
           "fish swim in deep blue sea", "old red boats"] * 2
  model = _model(lambda: _gpt2(_preprocessor()), "top_k", strategy)
  with strategy.scope() if strategy else contextlib.nullcontext():
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  sampler=SAMPLERS["top_k"]())
  model.fit(texts, batch_size=4, epochs=1, verbose=0, shuffle=False)
  return model.generate(prompts, max_length=LENGTH)


def test_string_prompts_through_the_preprocessor_after_fit():
  prompts = ["the cat", "a fish swims", "birds", "red boats"]
  expected = _fit_then_generate(prompts)
  got = _fit_then_generate(prompts, tfpar.TensorParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2})))
  assert got == expected
  # Stopped by the tokenizer's end token ("auto"), or at max_length.
  assert sum(len(e) > len(p) for e, p in zip(expected, prompts)) >= 3, expected


STRATEGIES = {
    "data2": lambda: tfpar.DataParallelStrategy(
        tfpar.Mesh({"data": 2}, devices=tfpar.Mesh().devices[:2])),
    "data4_zero3": lambda: tfpar.DataParallelStrategy(
        zero=tfpar.ZeRO(stage=3)),
    "data2_pipeline2": lambda: tfpar.PipelineParallelStrategy(
        tfpar.Mesh({"data": 2, "pipeline": 2}), num_microbatches=2),
}


@pytest.mark.parametrize("layout", sorted(STRATEGIES))
def test_generate_under_strategies_without_a_tensor_axis(layout):
  single = _one_device(_gpt2, "top_k")
  expected = single["first"]
  model = _model(_gpt2, "top_k", STRATEGIES[layout]())
  got = _generate(model)
  np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])
  if layout == "data4_zero3":  # Generated from 1/4 of the weights each.
    held = hub_common.bytes_by_device(model)
    total = sum(hub_common.bytes_by_device(single["model"]).values())
    assert len(held) == 4 and max(held.values()) < 0.3 * total, held


def test_mixtral_under_expert_x_tensor():
  strategy = tfpar.ExpertParallelStrategy(
      tfpar.Mesh({"data": 2, "tensor": 2}), expert=2)
  single = _one_device(_mixtral, "top_k")
  reference, expected = single["caches"], single["first"]
  with _caches(keras_hub.models.MixtralCausalLM) as seen:
    got = _generate(_model(_mixtral, "top_k", strategy))
  np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])
  # 2 key/value heads over 2 devices per tensor group.
  _check_split_cache(keras_hub.models.MixtralCausalLM, seen, reference,
                     _devices(4), 1 / 2)


def test_llama_under_pipeline_x_tensor():
  """3D: 2 stages of 2-device tensor groups. Each stage's layers run on
  its own devices, the cache split by heads as under tensor parallelism;
  it stays on stage 0's devices (the first two)."""
  strategy = tfpar.PipelineParallelStrategy(
      tfpar.Mesh({"data": 1, "pipeline": 2, "tensor": 2}), num_microbatches=2)
  for sampler in ("greedy", "top_k"):
    single = _one_device(_llama, sampler)
    reference, expected = single["caches"], single["first"]
    model = _model(_llama, sampler, strategy)
    with _caches(keras_hub.models.LlamaCausalLM) as seen:
      got = _generate(model)
    np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])
    _check_split_cache(keras_hub.models.LlamaCausalLM, seen, reference,
                       _devices(2), 1 / 2)
  # Each stage's matmuls ran on its own devices (the last transformer
  # layer's, of the second stage, on the last two).
  assert _matmul_devices(seen["graph"], "transformer_layer_1") == set(
      _devices(4)[2:])
  assert _matmul_devices(seen["graph"], "transformer_layer_0") == set(
      _devices(2))


def _matmul_devices(graph, scope):
  """Devices of the einsums / matmuls traced under name scope `scope`."""
  return {tf.DeviceSpec.from_string(op.device).to_string()
          for op in graph.get_operations()
          if op.type in ("Einsum", "MatMul", "BatchMatMulV2") and
          re.search(rf"(^|/){scope}(_\d+)?/", op.name)}


def test_what_generate_refuses():
  mesh = tfpar.Mesh({"data": 2, "tensor": 2})
  model = _model(_gpt2, "greedy", tfpar.TensorParallelStrategy(
      mesh, sequence_parallel=True))
  with pytest.raises(ValueError, match=r"sequence_parallel=True"):
    _generate(model)
  model = _model(_gpt2, "greedy", tfpar.TensorParallelStrategy(mesh))
  model.compile(sampler="greedy", run_eagerly=True)
  with pytest.raises(ValueError, match=r"run_eagerly=True"):
    _generate(model)
