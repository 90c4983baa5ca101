"""What running a step once per device of every tensor group (SPMD, the
one tensor-parallel design of tensor, pipeline and expert parallelism)
refuses before any work: `spmd=False`, a tensor group spanning workers,
eager runs."""

import tensorflow as tf


def check_spmd(spmd, strategy_name, allowed=(None, True)):
  """Refuses `spmd=False`, the retired replica-head design (and anything
  but a bool or None), before any work.

  Args:
    spmd: the strategy's `spmd` argument.
    strategy_name: the public strategy's class name, for the message.
    allowed: the values accepted (each means SPMD).

  Raises:
    ValueError: `spmd` is not one of `allowed`.
  """
  if spmd is False:
    raise ValueError(
        f"{strategy_name}(spmd=False): the replica-head tensor-parallel "
        f"design was retired; SPMD (every device of a tensor group traces "
        f"the step) is the one design. Leave spmd out. What only the head "
        f"design ran (run_eagerly=True, tensor groups across workers, "
        f"unknown attention dropout, Embedding subclasses, router jitter) "
        f"is refused by name when the model is built or run.")
  if not any(spmd is value for value in allowed):
    raise ValueError(
        f"spmd must be one of {', '.join(map(repr, allowed))} (SPMD, the "
        f"one tensor-parallel design). Received: spmd={spmd!r}")


def check_strategy(mesh):
  """Refuses meshes the SPMD strategy does not run on.

  Args:
    mesh: the `tfpar.Mesh`.

  Raises:
    ValueError: a multi-worker mesh with a tensor group spanning workers.
  """
  if mesh.cluster is None:
    return
  for group in mesh.replicas:
    tasks = sorted({tf.DeviceSpec.from_string(d).task or 0 for d in group})
    if len(tasks) > 1:
      raise ValueError(
          f"Tensor parallelism needs each tensor group on one worker; this "
          f"mesh's group {list(group)} spans the workers (tasks) {tasks}. "
          f"Choose a tensor size that divides each worker's device count.")


EAGER_REFUSAL = (
    "Tensor parallelism runs replica functions traced (each "
    "device of a tensor group traces its own copy, and their collectives "
    "cannot run one after another eagerly)")


def check_run(model):
  """Refuses a model compiled with `run_eagerly=True` as `fit`, `evaluate`
  or `predict` starts (`keras_hooks` calls it), before any work."""
  if model.run_eagerly:
    raise ValueError(
        f"{EAGER_REFUSAL}. Received: run_eagerly=True on model "
        f"{model.name!r}; compile with run_eagerly=False.")
