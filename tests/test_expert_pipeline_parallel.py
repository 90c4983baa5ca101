"""Expert x pipeline: `tfpar.PipelineParallelStrategy(mesh, expert=2)` on a
data 2 x pipeline 2 mesh, keras-hub's Mixtral (and Qwen-MoE) against one
device.

The model is cut into two stages (embedding and decoder 0; decoder 1, the
norm and the tied logits); each stage's MoE experts are split over the
stage's devices of the two data replicas. Expert bytes per device are
counted from every TensorFlow variable as it is constructed and released
(tests/variable_accounting.py), not from tfpar's bookkeeping.

The load-balancing loss is a product of two means over the tokens it sees
(fraction routed to each expert x mean router probability), so the mean
of the micro-batches' losses is not the whole batch's: Megatron-Core also
computes it per micro-batch. With it on, the reference is one device
looping over the same micro-batches (each the union of the replicas'
micro-batch k, as the pipeline's all-to-alls and statistics sums join
them); with it off, one device's `fit` on whole batches.
"""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import hub_common
import test_expert_parallel as ep
import tfpar
from variable_accounting import VariableAccounting

DATA, PIPELINE, MICROBATCHES, STEPS = 2, 2, 2, 5
MESH = {"data": DATA, "pipeline": PIPELINE}


def strategy(schedule="gpipe", expert=2, **kwargs):
  return tfpar.PipelineParallelStrategy(
      tfpar.Mesh(MESH), num_microbatches=MICROBATCHES, schedule=schedule,
      expert=expert, **kwargs)


def language_model(aux=0.02, num_experts=ep.EXPERTS, family="mixtral"):
  keras.utils.set_random_seed(1)
  common = dict(vocabulary_size=ep.VOCAB, num_layers=2, num_query_heads=4,
                num_key_value_heads=2, hidden_dim=ep.HIDDEN,
                intermediate_dim=64, num_experts=num_experts, top_k=ep.TOP_K)
  if family == "mixtral":
    backbone = keras_hub.models.MixtralBackbone(router_aux_loss_coef=aux,
                                                **common)
  else:  # Qwen-MoE: a shared expert beside the routed ones.
    backbone = keras_hub.models.QwenMoeBackbone(
        moe_intermediate_dim=32, shared_expert_intermediate_dim=64,
        router_aux_loss_coefficient=aux, **common)
  logits = backbone.token_embedding(backbone.output, reverse=True)
  return keras.Model(backbone.input, logits, name=f"{family}_lm")


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batches():
  return ep.dataset().take(STEPS)


def train(layout=None, aux=0.02, family="mixtral"):
  """(model, per-step logged losses) after STEPS steps of `fit`."""
  scope = layout.scope() if layout else tf.distribute.get_strategy().scope()
  with scope:
    model = language_model(aux, family=family)
    model.compile(optimizer=hub_common.optimizer("sgd"), loss=_loss())
  losses = []
  model.fit(batches(), epochs=1, verbose=0, callbacks=[
      keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs:
                                     losses.append(logs["loss"]))])
  return model, np.array(losses)


def one_device_micro_step(model, loss_fn, microbatches):
  """One device's step on one micro-batch, traced once: 1/m of its loss
  (compiled loss + load-balancing losses) and of its gradients."""
  @tf.function
  def micro_step(x, y):
    with tf.GradientTape() as tape:
      loss = (loss_fn(y, model(x, training=True)) +
              tf.add_n(model.losses)) / microbatches
    grads = tape.gradient(loss, model.trainable_variables)
    return loss, [tf.convert_to_tensor(g) for g in grads]
  return micro_step


def microbatch_reference(family="mixtral"):
  """One device looping over the pipeline's micro-batches: micro-batch k
  is the rows of every replica's micro-batch k; each adds 1/m of its loss
  (compiled loss + load-balancing losses) and gradients; one SGD step."""
  model = language_model(family=family)
  optimizer, loss_fn = hub_common.optimizer("sgd"), _loss()

  micro_step = one_device_micro_step(model, loss_fn, MICROBATCHES)

  losses = []
  for x, y in batches():
    rows = ep.BATCH // DATA // MICROBATCHES
    total, grads = 0.0, None
    for k in range(MICROBATCHES):
      index = np.concatenate([
          np.arange(start, start + rows) for start in
          range(k * rows, ep.BATCH, MICROBATCHES * rows)])
      loss, micro = micro_step(tf.nest.map_structure(
          lambda t: tf.gather(t, index), x), tf.gather(y, index))
      total += float(loss)
      grads = micro if grads is None else [a + b for a, b in
                                           zip(grads, micro)]
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    losses.append(total)
  # What fit logs: the running mean over the epoch's steps.
  return model, np.cumsum(losses) / np.arange(1, STEPS + 1)


class ExpertAccounting(VariableAccounting):
  """Live bytes per device of the expert weights and their slots only."""

  def _record(self, variable):
    if "expert_feedforward" in variable.name:
      super()._record(variable)


@pytest.fixture(scope="module")
def runs():
  reference = microbatch_reference()
  accounting = ExpertAccounting()
  layouts = {"gpipe": strategy("gpipe"), "1f1b": strategy("1f1b")}
  with accounting.counting():
    gpipe = train(layouts["gpipe"])
  trained = {"gpipe": gpipe, "1f1b": train(layouts["1f1b"])}
  return reference, trained, layouts, accounting


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_trains_as_one_device_over_the_same_microbatches(runs, schedule):
  (want, want_losses), trained, _, _ = runs
  model, losses = trained[schedule]
  assert len(losses) == STEPS
  np.testing.assert_allclose(losses, want_losses, atol=1e-5)
  difference = ep.max_weight_difference(model, want)
  ours, theirs = model.get_weights(), want.get_weights()
  assert [w.shape for w in ours] == [w.shape for w in theirs]
  whole = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))
  ep.assert_weights_listed_whole(model, want, 1e-5)
  print(f"\nMEASURED {schedule}: losses "
        f"{np.abs(losses - want_losses).max():.1e}, weights {difference:.1e}")
  assert difference < 1e-5 and whole < 1e-5


def test_evaluate_and_routing_match_one_device(runs):
  (want, _), trained, layouts, _ = runs
  model, _ = trained["gpipe"]
  want.compile(loss=_loss())
  np.testing.assert_allclose(model.evaluate(batches(), verbose=0),
                             want.evaluate(batches(), verbose=0), atol=1e-5)
  # Every assignment of every step (training, then evaluation) routed, none
  # dropped: each layer saw every token top-k times.
  routed = 2 * ep.BATCH * ep.SEQUENCE * STEPS * ep.TOP_K
  assert layouts["gpipe"].routing_report() == {
      block: (0, routed) for block in layouts["gpipe"].routing_report()}
  assert len(layouts["gpipe"].routing_report()) == 2


def test_without_the_load_balancing_loss_equals_whole_batches():
  # The only term that depends on how the batch is cut is the
  # load-balancing loss: without it, one device's fit on whole batches.
  want, want_losses = train(aux=0.0)
  model, losses = train(strategy("1f1b"), aux=0.0)
  difference = ep.max_weight_difference(model, want)
  print(f"\nMEASURED no load-balancing loss, whole batches: losses "
        f"{np.abs(losses - want_losses).max():.1e}, weights {difference:.1e}")
  np.testing.assert_allclose(losses, want_losses, atol=1e-5)
  assert difference < 1e-5


def test_qwen_moe_with_its_shared_expert_trains_as_one_device():
  want, want_losses = microbatch_reference("qwen_moe")
  model, losses = train(strategy("1f1b"), family="qwen_moe")
  difference = ep.max_weight_difference(model, want)
  print(f"\nMEASURED Qwen-MoE 1f1b: losses "
        f"{np.abs(losses - want_losses).max():.1e}, weights {difference:.1e}")
  np.testing.assert_allclose(losses, want_losses, atol=1e-5)
  assert difference < 1e-5


def test_each_device_holds_a_quarter_of_the_experts(runs):
  (want, _), trained, layouts, accounting = runs
  model, _ = trained["gpipe"]
  whole = sum(int(np.prod(v.shape)) * 4 for v in want.weights
              if "/experts/" in v.path)
  assert whole == 196_608  # 2 layers x 3 weights x [4, 32, 64] float32.
  # Each device: its stage's layer's experts, 1/expert of them, and their
  # SGD momentum: 1/(expert x pipeline) of the whole, twice.
  live = accounting.now()
  assert live == {f"CPU:{d}": 2 * whole // 4 for d in range(4)}, live
  print(f"\nMEASURED expert bytes per device {live}, peak while building "
        f"{dict(accounting.peak)}, whole {whole}")
  # Stage s's experts on device s of each replica; replicas of one expert
  # rank hold the same experts, of different ranks different ones.
  for block, column in (("transformer_layer_0", 0),
                        ("transformer_layer_1", 1)):
    variables = [v for v in model.trainable_weights
                 if v.path.startswith(block) and "/experts/" in v.path]
    assert len(variables) == 3
    for variable in variables:
      ep.assert_ranks_hold_their_experts(variable, 2)
      devices = ep.expert_bytes_by_device([variable])
      assert sorted(d.split("device:")[-1] for d in devices) == [
          f"CPU:{column}", f"CPU:{column + PIPELINE}"]
  text = layouts["gpipe"].describe(model, print_fn=None)
  rows = [line for line in text.splitlines() if "/experts/" in line]
  assert len(rows) == 6
  assert sum("(expert 2, stage device 1)" in row and
             row.endswith("0: CPU:1 | 1: CPU:3") for row in rows) == 3, rows


def _cluster_mesh():
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({"worker": ["127.0.0.1:2000", "127.0.0.1:2001"]}),
      task_type="worker", task_id=1)
  return tfpar.Mesh.from_cluster_resolver(resolver, data=4, pipeline=2)


@pytest.mark.parametrize("mesh, kwargs, message", [
    (lambda: tfpar.Mesh(MESH), dict(expert=3),
     r"expert=3 does not divide the mesh's data size 2"),
    (lambda: tfpar.Mesh(MESH), dict(expert=0),
     r"expert must be None or a positive integer"),
    (lambda: tfpar.Mesh(MESH), dict(expert=2, schedule="interleaved",
                                    virtual_stages=2),
     r"schedule='interleaved' with split experts is not supported yet"),
    (lambda: tfpar.Mesh(MESH), dict(expert=2, recompute=True),
     r"expert=2 does not combine with recompute=True"),
    (lambda: tfpar.Mesh(MESH), dict(expert=2, capacity_factor=0),
     r"capacity_factor must be None \(drop nothing\) or a positive number"),
    (lambda: tfpar.Mesh(MESH), dict(capacity_factor=1.0),
     r"capacity_factor=1.0 bounds the tokens of split experts; set expert="),
    (lambda: tfpar.Mesh({"pipeline": 2, "tensor": 2}), dict(expert=1),
     r"expert=1 with a tensor axis \(tensor=2\) is not supported on a "
     r"pipeline yet"),
    (_cluster_mesh, dict(expert=2),
     r"expert=2 on a pipeline runs inside one worker for now; the mesh "
     r"spans 2 workers"),
])
def test_bad_settings_fail_before_any_work(mesh, kwargs, message):
  options = dict(num_microbatches=MICROBATCHES, **kwargs)
  with pytest.raises(ValueError, match=message):
    tfpar.PipelineParallelStrategy(mesh(), **options)


def test_experts_not_divisible_fail_when_built():
  layout = strategy("1f1b")
  with pytest.raises(ValueError, match=r"num_experts=3 is not divisible by "
                     r"expert=2"):
    with layout.scope():
      language_model(num_experts=3)


@pytest.mark.parametrize("clipping", [{"clipvalue": 0.1}])
def test_clipping_is_refused_before_the_first_step(clipping):
  """Keras would clip each replica's gradient before the sum: refused,
  with the optimizer still unbuilt (no step ran). `clipnorm` and
  `global_clipnorm` take the same check."""
  layout = strategy("1f1b")
  optimizer = keras.optimizers.SGD(0.01, **clipping)
  name = next(iter(clipping))
  with pytest.raises(ValueError, match=rf"has {name}=.*does not clip the "
                     r"summed gradient as one device does yet"):
    with layout.scope():  # Models compiled in the scope: checked on leaving.
      model = language_model()
      model.compile(optimizer=optimizer, loss=_loss())
  assert not optimizer.built
