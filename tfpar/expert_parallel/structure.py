"""An MoE block's router, stacked experts and shared expert, read off its
layers and weights.

Nothing here names a keras-hub attribute: a block's parts are found by
what they are.

* The **expert bank** is the one direct sublayer owning stacked expert
  weights (its own variables of rank 3 or more whose first axis is
  `num_experts`); every one of its own variables must have that first
  axis (kernels and GPT-OSS's per-expert biases alike). They are split
  over the expert group, and the experts run through **the bank's own
  `call`**, one expert at a time on that expert's tokens, with the
  expert's slices in place of the stacked weights (`_BankView`): keras-hub's
  arithmetic (activations, clamps, biases, interleaved gate/up columns)
  is the one that runs, not a copy of it.
* The **router** is the direct sublayer that is a `Dense` to `num_experts`
  logits, or, for a row with `scores=True` (GPT-OSS), the direct sublayer
  holding such a `Dense` that returns the routing scores itself.
* A **shared expert** is a direct `Dense` to 1 unit (its gate) next to one
  more sublayer (its MLP): the block adds `sigmoid(gate(x)) * mlp(x)`
  (Qwen-MoE, Qwen3.5-MoE).

A block with any other sublayer is refused: tfpar would not know how to
run it.
"""

import dataclasses
from typing import Optional

import keras
import tensorflow as tf

from tfpar._compat import keras_layers
from tfpar.expert_parallel import routing


@dataclasses.dataclass(frozen=True)
class Row:
  """What one MoE block class does that its layers do not show: how the
  router's output becomes each token's experts and weights.

  Attributes:
    scores: the router layer returns [T, E] routing scores, the weights of
      each token's top-k experts and zeros elsewhere (GPT-OSS: top-k of the
      logits, then a softmax over those k); else it returns logits, and
      the block takes their softmax, then the top k.
    normalize: whether the top-k probabilities are divided by their sum:
      a bool, or the name of the block's attribute that says.
    aux_coefficient: the block's attribute holding its load-balancing
      loss coefficient, or None (no such loss).
    jitter: the block's attribute holding the router's jitter noise, or
      None.
    contraction: how the block sums each token's weighted expert outputs
      (`routing.combine`): "multiply" (products, then a sum: keras-hub's)
      or "matmul" (`tfpar.MoE`'s).
    bank_compute: the name of a bank method taking (expert weights,
      x [E', N, h]) for all local experts at once (`tfpar.MoE`'s
      `ExpertBank.compute`), or None: the bank's own `call`, expert by
      expert.
  """
  scores: bool = False
  normalize: object = True
  aux_coefficient: Optional[str] = None
  jitter: Optional[str] = None
  contraction: str = "multiply"
  bank_compute: Optional[str] = None


class _BankView:
  """The expert bank with some weights replaced by tensors, for running
  the bank's own `call` on one expert's slices."""

  def __init__(self, bank, replaced):
    self.__dict__.update(replaced)
    self.__dict__["tfpar_bank"] = bank

  def __getattr__(self, name):
    return getattr(self.__dict__["tfpar_bank"], name)


@dataclasses.dataclass(frozen=True)
class MoELayout:
  """The parts of one MoE block and how it computes.

  Attributes:
    name: the block's class name (its row's key in `families.ROWS`).
    row: its `Row`.
    router: the router layer.
    bank: the expert bank layer.
    expert_weight_names: the bank's attributes holding the stacked
      [num_experts, ...] weights, in creation order.
    shared: (gate, mlp) of a shared expert, or None.
  """
  name: str
  row: Row
  router: keras.layers.Layer
  bank: keras.layers.Layer
  expert_weight_names: tuple
  shared: Optional[tuple] = None

  @property
  def jitter(self):
    return self.row.jitter

  @property
  def aux_coefficient(self):
    return self.row.aux_coefficient

  @property
  def contraction(self):
    return self.row.contraction

  def normalize(self, block):
    wanted = self.row.normalize
    return bool(getattr(block, wanted)) if isinstance(wanted, str) else wanted

  def route(self, block, x):
    """(what the block returns next to its output, router probabilities
    for the load-balancing loss or None, weights [T, k], experts [T, k])
    of tokens x [T, h]."""
    out = self.router(x)
    if self.row.scores:
      weights, experts = tf.math.top_k(out, k=block.top_k)
      return out, None, weights, experts
    probs = tf.nn.softmax(out, axis=-1)
    weights, experts = routing.route(probs, block.top_k,
                                     self.normalize(block))
    return out, probs, weights, experts

  def experts(self, weights, x):
    """x [E', N, h] through E' experts whose stacked weights are `weights`
    (tensors in `expert_weight_names` order): [E', N, h]."""
    if self.row.bank_compute:
      return getattr(self.bank, self.row.bank_compute)(weights, x)
    call = type(self.bank).call
    outputs = []
    for e in range(weights[0].shape[0]):
      view = _BankView(self.bank, {
          name: w[e:e + 1] for name, w in zip(self.expert_weight_names,
                                              weights)})
      outputs.append(call(view, x[e]))
    return tf.concat(outputs, 0)

  def extra(self, x):
    """What the block adds to the routed experts' output for tokens
    x [T, h] (its shared expert), or None."""
    if self.shared is None:
      return None
    gate, mlp = self.shared
    return mlp(x) * tf.sigmoid(gate(x))


def _refuse(block, rule):
  raise ValueError(
      f"Layer {block.path!r} ({type(block).__name__}): {rule}, so tfpar "
      f"cannot tell how to split its experts.")


def _is_dense_to(layer, units):
  return isinstance(layer, keras.layers.Dense) and layer.units == units


def _stacked(variable, num_experts):
  return len(variable.shape) >= 2 and variable.shape[0] == num_experts


def _bank_of(block, children):
  num_experts = block.num_experts
  banks = [c for c in children
           if any(len(v.shape) >= 3 and _stacked(v, num_experts)
                  for v in keras_layers.own_variables(c))]
  if len(banks) != 1:
    _refuse(block, f"{len(banks)} sublayers hold stacked [num_experts="
            f"{num_experts}, ...] weights ({[c.name for c in banks]}), "
            f"where an expert bank is one")
  bank = banks[0]
  own = keras_layers.own_variables(bank)
  odd = [v.path for v in own if not _stacked(v, num_experts)]
  if odd:
    _refuse(block, f"its expert bank {bank.name!r} also holds {odd}, "
            f"whose first axis is not num_experts={num_experts}")
  names = []
  for variable in own:
    found = [a for a, value in vars(bank).items() if value is variable]
    if len(found) != 1:
      _refuse(block, f"its expert bank holds {variable.path!r} under "
              f"{len(found)} attributes")
    names.append(found[0])
  return bank, tuple(names)


def _router_of(block, row, children):
  num_experts = block.num_experts
  if row.scores:
    routers = [c for c in children
               if not isinstance(c, keras.layers.Dense) and any(
                   _is_dense_to(d, num_experts)
                   for d in keras_layers.flatten_layers(c))]
  else:
    routers = [c for c in children if _is_dense_to(c, num_experts)]
  if len(routers) != 1:
    what = ("sublayers holding a Dense" if row.scores else "Dense sublayers")
    _refuse(block, f"{len(routers)} {what} to num_experts={num_experts} "
            f"units ({[c.name for c in routers]}), where the router is one")
  return routers[0]


def layout_of(block, name, row):
  """The `MoELayout` of a built block of the class `name` (row `row`).

  Raises:
    ValueError: the block's sublayers are not a router, an expert bank and
      optionally a shared expert with its gate.
  """
  children = keras_layers.flatten_layers(block, include_self=False,
                                         recursive=False)
  bank, names = _bank_of(block, children)
  router = _router_of(block, row, children)
  rest = [c for c in children if c is not bank and c is not router]
  shared = None
  gates = [c for c in rest if _is_dense_to(c, 1)]
  if len(gates) == 1 and len(rest) == 2:
    shared = (gates[0], next(c for c in rest if c is not gates[0]))
  elif rest:
    _refuse(block, f"besides its router {router.name!r} and expert bank "
            f"{bank.name!r} it has {[c.name for c in rest]}, which are not a "
            f"shared expert (one MLP and a Dense to 1 unit, its gate)")
  return MoELayout(name, row, router, bank, names, shared)
