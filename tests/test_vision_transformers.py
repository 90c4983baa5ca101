"""keras-hub vision transformers under data 2 x tensor 2 against one
device: ViT, SigLIP's vision encoder (with its attention-pooling head)
and DINOv2, each with a linear probe, 4 SGD steps. Their attention
(stock MultiHeadAttention) is split by heads and their MLPs column- then
row-parallel; patch convolutions, class tokens and position tables stay
whole (a position `Embedding` whose ids are not computed from the
inputs, tfpar/tensor_parallel/structure.reads_model_inputs)."""

import keras
import keras_hub
import numpy as np
import pytest

import attention_common

IMAGE = (8, 8, 3)
CLASSES = 5
M = keras_hub.models
# 1 block, hidden 16, 4 heads, MLP 32, 2x2 patches (16 patches).
BACKBONES = {
    "vit": lambda: M.ViTBackbone(
        image_shape=IMAGE, patch_size=2, num_layers=1, num_heads=4,
        hidden_dim=16, mlp_dim=32),
    "siglip": lambda: M.SigLIPVisionEncoder(
        patch_size=2, hidden_dim=16, num_layers=1, num_heads=4,
        intermediate_dim=32, image_shape=IMAGE),
    "dinov2": lambda: M.DINOV2Backbone(
        patch_size=2, num_layers=1, hidden_dim=16, num_heads=4,
        intermediate_dim=32, image_shape=IMAGE,
        position_embedding_shape=IMAGE),
}
# The layers Megatron splits: attention projections and MLPs.
_SPLIT = ("query", "key", "value", "attention_output", "dense_1", "dense_2",
          "fc1", "fc2")


def _classifier(name):
  backbone = BACKBONES[name]()
  hidden = backbone.output
  if len(hidden.shape) == 3:
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
  return keras.Model(backbone.input,
                     keras.layers.Dense(CLASSES, name="probe")(hidden))


def _is_split(weight):
  return weight.path.split("/")[-2] in _SPLIT and (
      weight.path.endswith("kernel"))


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_vision_transformer_trains_like_one_device_split(name):
  rng = np.random.default_rng(0)
  count = attention_common.BATCH * attention_common.STEPS
  x = rng.normal(size=(count,) + IMAGE).astype("float32")
  y = rng.integers(0, CLASSES, count)
  reference, model, worst, strategy = attention_common.compare(
      lambda: _classifier(name), x, y)
  assert worst < 1e-6, worst
  kernels = [w.path for w in reference.weights if _is_split(w)]
  assert len(kernels) >= 6, kernels  # 4 attention + 2 MLP per block.
  for path in kernels:
    assert attention_common.halved_on_every_device(
        model, reference, path, strategy), path
  fullest, share = attention_common.fullest_and_megatron(
      model, reference, _is_split)
  assert fullest <= share * 1.05, (fullest, share)
  total = sum(np.asarray(w).nbytes for w in reference.get_weights())
  print(f"| {name} | {worst:.1e} | {fullest:,} / {total:,} = "
        f"{fullest / total:.3f} | Megatron {share / total:.3f} |")
