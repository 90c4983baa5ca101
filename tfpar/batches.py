"""Global batch checks shared by the strategies (no TensorFlow import).

Keras's TensorFlow trainer reduces the first batch of every `fit` and
`evaluate` across replicas (`_maybe_symbolic_build`), which fails inside a
collective ("Shape mismatch in the collective instance") unless every
replica gets the same number of rows. So a global batch must split evenly
over the data replicas; `tfpar` refuses other batch sizes before any work.
"""


def check_even_split(batch_size, replicas, what="batch_size"):
  """Raises a ValueError unless `batch_size` is a multiple of `replicas`.

  Args:
    batch_size: the global batch size, or None (not known: no check).
    replicas: the data size (`strategy.num_replicas_in_sync`).
    what: how the message names the batch size.

  Raises:
    ValueError: `batch_size` is not a positive multiple of `replicas`.

  Example:

  >>> check_even_split(32, 4)
  >>> check_even_split(30, 4)
  Traceback (most recent call last):
  ...
  ValueError: batch_size=30 does not split evenly over the data size 4 (the number of data replicas): it must be a multiple of 4, e.g. 28 or 32.
  """
  if batch_size is None or replicas <= 1 or batch_size % replicas == 0:
    return
  lower = batch_size // replicas * replicas
  options = " or ".join(str(b) for b in (lower, lower + replicas) if b > 0)
  raise ValueError(
      f"{what}={batch_size} does not split evenly over the data size "
      f"{replicas} (the number of data replicas): it must be a multiple of "
      f"{replicas}, e.g. {options}.")


def dataset_batch_size(dataset):
  """The batch size a `tf.data` pipeline was batched with, or None.

  Args:
    dataset: a `tf.data.Dataset` (anything else: None).

  Returns:
    The `batch_size` of the last `batch()` in the pipeline, looking through
    `map`, `prefetch` and similar stages, or None when it is not known.

  Example:

  >>> import tensorflow as tf
  >>> dataset_batch_size(tf.data.Dataset.range(10).batch(6).prefetch(1))
  6
  """
  from tfpar._compat import runtime  # pylint: disable=g-import-not-at-top
  return runtime.dataset_batch_size(dataset)
