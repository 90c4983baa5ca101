"""How much of a model a sharding plan splits, and refusing to replicate the
model's largest weights silently."""

import dataclasses

import numpy as np

from tfpar.tensor_parallel import styles


@dataclasses.dataclass(frozen=True)
class Coverage:
  """Parameters split over the tensor axis and kept whole.

  Attributes:
    split: {path: elements} of the weights split over the tensor axis.
    replicated: {path: elements} of the weights every replica holds whole.
    elsewhere: {path: elements} of the weights another parallelism splits
      (the experts of MoE layers under expert x tensor).
  """
  split: dict
  replicated: dict
  elsewhere: dict = dataclasses.field(default_factory=dict)

  def _total(self):
    return sum(sum(d.values()) for d in (self.split, self.replicated,
                                          self.elsewhere))

  @property
  def fraction_split(self):
    """The fraction of all parameters (elements) split over the tensor
    axis."""
    total = self._total()
    return sum(self.split.values()) / total if total else 0.0

  def summary(self):
    """Two lines (three with `elsewhere`): the fraction split, what
    another parallelism splits, then what stays replicated."""
    split = sum(self.split.values())
    total = self._total()
    kept = sorted(self.replicated.items(), key=lambda item: -item[1])
    lines = [f"split over the tensor axis: {self.fraction_split:.1%} of the "
             f"parameters ({split:,} of {total:,})"]
    if self.elsewhere:
      other = sum(self.elsewhere.values())
      lines.append(f"split over the expert group x tensor (experts): "
                   f"{other / total:.1%} ({other:,} of {total:,})")
    lines.append(f"replicated ({len(kept)}): " +
                 (", ".join(f"{path} ({count:,})" for path, count in kept)
                  or "nothing"))
    return "\n".join(lines)


def coverage(weights, layer_layouts, elsewhere=()):
  """The `Coverage` of a model under resolved `layer_layouts`.

  Args:
    weights: (path, full shape) of every logical weight of the model.
    layer_layouts: the `LayerLayout`s the plan resolved.
    elsewhere: paths of weights another parallelism splits.
  """
  split_paths = {v.path for layout in layer_layouts for v in layout.variables
                 if v.axis is not None}
  elsewhere = set(elsewhere)
  split, replicated, other = {}, {}, {}
  for path, shape in weights:
    found = (other if path in elsewhere else
             split if path in split_paths else replicated)
    found[path] = int(np.prod(shape))
  return Coverage(split, replicated, other)


def check_large_replicated(model, found, user, owner):
  """Raises if a weight larger than every split weight stays replicated
  without a `tfpar.Replicate()` rule for it.

  Args:
    model: the model.
    found: its `Coverage`.
    user: {path: (style, source)} of the plan's rules.
    owner: `owner(path)` names the layer that holds the weight.

  Raises:
    ValueError: naming the weight and the rule that accepts it.
  """
  largest_split = max(found.split.values(), default=0)
  for path, count in sorted(found.replicated.items(), key=lambda i: -i[1]):
    if count <= largest_split:
      break
    if path in user and isinstance(user[path][0], styles.Replicate):
      continue
    raise ValueError(
        f"Weight {path!r} of model {model.name!r} ({count:,} parameters) "
        f"would stay replicated on every device although it is larger than "
        f"every weight the plan splits ({largest_split:,}): tfpar has no "
        f"built-in plan for {owner(path)}. Split it with a rule, or accept "
        f"the "
        f"replication with tfpar.ShardingPlan([({path!r}, "
        f"tfpar.Replicate())]).")
