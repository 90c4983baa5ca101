"""How one weight is laid out over the `tensor` axis of a mesh.

A style names a Megatron-LM layout. Which axis of a weight it splits follows
from the layer that owns the weight: a `ColumnParallel` Dense kernel
`[in, out]` is split on `out`, a `RowParallel` one on `in`; for an
`EinsumDense` kernel the column axis is its first output-only axis and the
row axis its first contracted axis (the heads axis of attention projections).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Style:
  """Base class of the sharding styles. Use one of its subclasses."""

  @property
  def name(self):
    return type(self).__name__

  def __str__(self):
    return self.name


@dataclasses.dataclass(frozen=True)
class ColumnParallel(Style):
  """Split a projection's output features; each device computes its slice.

  The bias is split with the kernel. The output stays split when the next
  layer is `RowParallel` (Megatron's MLP and attention pairs) and is gathered
  otherwise.

  Example:

  >>> import tfpar
  >>> plan = tfpar.ShardingPlan([(r"mlp_in/(kernel|bias)",
  ...                             tfpar.ColumnParallel())])
  """


@dataclasses.dataclass(frozen=True)
class RowParallel(Style):
  """Split a projection's input features; partial outputs are summed.

  The bias is not split: it is added once, after the sum.

  Example:

  >>> import tfpar
  >>> plan = tfpar.ShardingPlan([(r"mlp_out/kernel", tfpar.RowParallel())])
  """


@dataclasses.dataclass(frozen=True)
class VocabParallel(Style):
  """Split an embedding table on the vocabulary (Megatron's
  `VocabParallelEmbedding`): each device looks up the ids in its range.

  Example:

  >>> import tfpar
  >>> plan = tfpar.ShardingPlan([(r"token_embedding/embeddings",
  ...                             tfpar.VocabParallel())])
  """


@dataclasses.dataclass(frozen=True)
class Replicate(Style):
  """Keep the whole weight on the head device of every replica.

  Example:

  >>> import tfpar
  >>> plan = tfpar.ShardingPlan([(r"classifier/.*", tfpar.Replicate())])
  """


COLUMN = ColumnParallel()
ROW = RowParallel()
VOCAB = VocabParallel()
REPLICATE = Replicate()
