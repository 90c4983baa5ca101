"""Running one replica's pipeline for one step, in a schedule's order.

Each stage's work runs on its device (`tf.device`) under a name scope
`tfpar_pipeline/stage{s}/microbatch{k}/{forward|backward}` that traces and
profiles identify it by. TF's executor imposes no order on independent ops
(on virtual CPUs it runs backwards before forwards and several micro-batches
of one stage at once), so every work item takes a control dependency on the
outputs of the work its device ran before: the order is the schedule's.

A forward records a `tf.GradientTape` of its stage (or, with activation
recomputation, keeps only its input and records the tape again in the
backward); the backward takes the gradient of the stage output with the
next stage's input gradient as `output_gradients`, and of the stage's own
loss terms, and adds the variable gradients to the stage's running sums.
A variable that several stages use (a tied embedding) gets the sum of
their gradients. Integer tensors crossing a cut (padding masks) get none.
"""

import contextlib

import tensorflow as tf

from tfpar.common import recomputed_state
from tfpar.pipeline import comm
from tfpar.pipeline import schedules

SCOPE = "tfpar_pipeline"


def work_scope(work):
  """The name scope of one work item (parsed back by `tfpar.pipeline.trace`)."""
  return f"{SCOPE}/stage{work.stage}/microbatch{work.microbatch}/{work.phase}"


def _flat(structure):
  return [t for t in tf.nest.flatten(structure) if t is not None]


def _float_tensors(structure):
  return [t for t in _flat(structure) if t.dtype.is_floating]


# A tensor-parallel stage computes each shard's gradient on the shard's
# device; summing micro-batches there keeps it off the stage's head.
def _where_computed(gradient):
  device = getattr(gradient, "device", None)
  return tf.device(device) if device else contextlib.nullcontext()


# Sparse gradients (an Embedding's IndexedSlices) stay sparse: the
# micro-batches' rows are concatenated, as one device's batch has them all,
# so that the optimizer applies them as on one device (Keras's Adam squares
# each repeated row on its own).
def _summable(gradient):
  if isinstance(gradient, tf.IndexedSlices):
    return gradient
  with _where_computed(gradient):
    return tf.convert_to_tensor(gradient)


def _add_where_computed(total, gradient, where=None):
  with _where_computed(gradient if where is None else where):
    if isinstance(total, tf.IndexedSlices) and isinstance(
        gradient, tf.IndexedSlices):
      return tf.IndexedSlices(
          tf.concat([total.values, gradient.values], 0),
          tf.concat([total.indices, gradient.indices], 0), total.dense_shape)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(gradient)


def _accumulate(total, gradient):
  if total is None or gradient is None:
    return gradient if total is None else total
  return _add_where_computed(total, gradient)


# One device sums an embedding's sparse gradient and the dense one of its
# reversed use (tied logits) into a dense gradient; so does the pipeline.
def _dense(gradient, other):
  if isinstance(gradient, tf.IndexedSlices) and not isinstance(
      other, tf.IndexedSlices):
    with _where_computed(gradient):
      return tf.convert_to_tensor(gradient)
  return gradient


class StageRunner:
  """Runs the stages of one replica in a schedule's order.

  Args:
    stage_models: the Keras sub-model of each stage.
    devices: the device of each stage in this replica (stage `s` and
      stage `s + p` share a device under `interleaved`).
    schedule: a name from `schedules.SCHEDULES`.
    recompute: keep only stage inputs in the forward and recompute the
      stage in its backward.
    virtual_stages: stages per device, v (`interleaved`); the pipeline
      has `len(stage_models) / v` devices.

  Example:

  >>> runner = StageRunner(models, ["/CPU:0", "/CPU:1"], "1f1b")  # doctest: +SKIP
  >>> outputs, loss, grads = runner.train(microbatches, loss_fn, extra_fn)  # doctest: +SKIP
  """

  def __init__(self, stage_models, devices, schedule, recompute=False,
               virtual_stages=1):
    self._models = list(stage_models)
    self._devices = list(devices)
    self._schedule = schedule
    self._recompute = recompute
    self._virtual_stages = virtual_stages

  @property
  def num_stages(self):
    return len(self._models)

  @property
  def pipeline_size(self):
    """The devices of the pipeline (stage `s` runs on `s % pipeline_size`)."""
    return self.num_stages // self._virtual_stages

  def _orders(self, num_microbatches, backward=True):
    return schedules.device_orders(self._schedule, self.pipeline_size,
                                   num_microbatches, self._virtual_stages,
                                   backward)

  def predict(self, microbatches, training=False, extra_loss_fn=None):
    """Forward passes only.

    Args:
      microbatches: the input of stage 0 per micro-batch.
      training: passed to the stage models.
      extra_loss_fn: optional, as in `train`.

    Returns:
      (the last stage's output per micro-batch, the sum of the extra
      losses, 0 without `extra_loss_fn`).
    """
    orders = self._orders(len(microbatches), backward=False)
    activations = {}
    extras = [tf.zeros(())]
    # Each device's work takes a control dependency on the outputs of the
    # work it ran before: the order is the schedule's.
    chain = [[] for _ in range(self.pipeline_size)]
    for work in schedules.build_order(orders):
      s, k = work.stage, work.microbatch
      d = s % self.pipeline_size
      source = microbatches[k] if s == 0 else activations.pop((s - 1, k))
      with tf.device(self._devices[s]), tf.name_scope(work_scope(work)), \
          tf.control_dependencies(chain[d]):
        inputs = comm.send(source, self._devices[s])
        outputs = self._models[s](inputs, training=training)
        if extra_loss_fn is not None:
          extras.append(extra_loss_fn(k, self._models[s]))
      activations[(s, k)] = outputs
      chain[d] = _flat(outputs)
    return ([activations[(self.num_stages - 1, k)]
             for k in range(len(microbatches))],
            tf.add_n([tf.identity(e) for e in extras]))

  def train(self, microbatches, loss_fn, extra_loss_fn):
    """Forward and backward of every micro-batch, in schedule order.

    Args:
      microbatches: the input of stage 0 per micro-batch.
      loss_fn: `loss_fn(k, outputs)`, the weighted loss of micro-batch k
        from the last stage's outputs (a scalar on the last device).
      extra_loss_fn: `extra_loss_fn(k, stage_model)`, the weighted
        additional losses (`stage_model.losses`) of a stage's forward.

    Returns:
      (outputs per micro-batch, total loss, {id(variable): gradient}) where
      the loss sums every micro-batch's and stage's terms and the gradients
      sum every micro-batch's and stage's (None for a variable no stage's
      output depends on, as one device's tape gives).
    """
    m, p = len(microbatches), self.num_stages
    orders = self._orders(m)
    variables = [list(model.trainable_variables) for model in self._models]
    saved = {}  # (s, k) -> (inputs, outputs, objective, tape, state)
    activations, input_grads, outputs_by_k = {}, {}, {}
    grad_sums = [None] * p
    losses = []
    chain = [[] for _ in range(self.pipeline_size)]  # Per device.
    for work in schedules.build_order(orders):
      s, k = work.stage, work.microbatch
      d = s % self.pipeline_size
      with tf.device(self._devices[s]), tf.name_scope(work_scope(work)), \
          tf.control_dependencies(chain[d]):
        if work.phase == schedules.FORWARD:
          source = microbatches[k] if s == 0 else activations.pop((s - 1, k))
          inputs = comm.send(source, self._devices[s])
          state = tape = None
          if self._recompute:
            state = recomputed_state.CallState(
                self._models[s].non_trainable_variables)
            with state.recorded():
              outputs, objective = self._forward(s, k, inputs, loss_fn,
                                                 extra_loss_fn)
          else:
            outputs, objective, tape = self._taped_forward(
                s, k, inputs, loss_fn, extra_loss_fn)
          saved[(s, k)] = (inputs, outputs, objective, tape, state)
          losses.append(objective)
          if s < p - 1:
            activations[(s, k)] = outputs
          else:
            outputs_by_k[k] = outputs
          chain[d] = _flat(outputs) + [objective]
        else:
          inputs, outputs, objective, tape, state = saved.pop((s, k))
          if tape is None:
            # Recompute the stage, recording it this time; what it assigns
            # (batch normalization's moving statistics, which took this
            # micro-batch in the forward already) it leaves as it was.
            with state.undone():
              outputs, objective, tape = self._taped_forward(
                  s, k, inputs, loss_fn, extra_loss_fn)
          targets, upstream = [objective], [tf.ones_like(objective)]
          if s < p - 1:
            received = comm.send(input_grads.pop((s + 1, k)),
                                 self._devices[s])
            targets += _float_tensors(outputs)
            upstream += received
          sources = (_float_tensors(inputs) if s else []) + variables[s]
          # Unconnected gradients are None: TF's zeros for a Keras variable
          # fail on its string dtype, and a variable a stage does not use
          # (the half of a shared layer another stage calls) has none.
          grads = tape.gradient(targets, sources, output_gradients=upstream)
          num_inputs = len(sources) - len(variables[s])
          input_grad = [tf.zeros_like(x) if g is None else g
                        for x, g in zip(sources[:num_inputs], grads)]
          if s:
            input_grads[(s, k)] = input_grad
          var_grads = [None if g is None else _summable(g)
                       for g in grads[num_inputs:]]
          grad_sums[s] = var_grads if grad_sums[s] is None else [
              _accumulate(a, g) for a, g in zip(grad_sums[s], var_grads)]
          chain[d] = input_grad + _flat(grad_sums[s])
    gradients = {}
    for s in range(p):
      for variable, grad in zip(variables[s], grad_sums[s] or []):
        key = id(variable)
        if grad is None:
          gradients.setdefault(key, None)
          continue
        if gradients.get(key) is not None:  # Several stages use it (tied).
          # Summed where the first (owning) stage's gradient is.
          grad = _add_where_computed(_dense(gradients[key], grad),
                                     _dense(grad, gradients[key]),
                                     where=gradients[key])
        gradients[key] = grad
    total = tf.add_n([tf.identity(l) for l in losses])
    return [outputs_by_k[k] for k in range(m)], total, gradients

  def _taped_forward(self, s, k, inputs, loss_fn, extra_loss_fn):
    with tf.GradientTape() as tape:
      tape.watch(_float_tensors(inputs) if s else [])
      outputs, objective = self._forward(s, k, inputs, loss_fn,
                                         extra_loss_fn)
    return outputs, objective, tape

  def _forward(self, s, k, inputs, loss_fn, extra_loss_fn):
    outputs = self._models[s](inputs, training=True)
    objective = extra_loss_fn(k, self._models[s])
    if s == self.num_stages - 1:
      objective = objective + loss_fn(k, outputs)
    return outputs, objective
