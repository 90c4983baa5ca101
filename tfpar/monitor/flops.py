"""FLOPs of one traced op: the matrix products (MatMul, BatchMatMul,
two-operand Einsum, 2-D convolutions and their gradients), counted as
2 x (output elements) x (contracted size) from static shapes.

Element-wise ops, reductions, the loss and the optimizer's update are left
out, as in the usual model-FLOPs count that MFU is measured against.
"""

import math

_CONVOLUTIONS = ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter",
                 "DepthwiseConv2dNative",
                 "DepthwiseConv2dNativeBackpropInput",
                 "DepthwiseConv2dNativeBackpropFilter")


class UnknownShape(ValueError):
  """A matrix product whose shapes are not static (a dynamic batch)."""


def _dims(tensor, op):
  dims = tensor.shape.as_list() if tensor.shape.rank is not None else None
  if dims is None or any(d is None for d in dims):
    raise UnknownShape(f"op {op.name!r} ({op.type}) has a dynamic shape "
                       f"{tensor.shape}")
  return dims


def _einsum(op):
  inputs, output = op.get_attr("equation").decode().replace(" ", "").split(
      "->")
  terms = inputs.split(",")
  if len(terms) != 2:
    return 0  # A transpose or a reduction: no multiplications.
  sizes = {}
  for term, tensor in zip(terms, op.inputs):
    dims = _dims(tensor, op)
    head, _, tail = term.partition("...")
    sizes.update(zip(head, dims[:len(head)]))
    if tail:
      sizes.update(zip(tail, dims[len(dims) - len(tail):]))
  contracted = math.prod(size for letter, size in sizes.items()
                         if letter not in output)
  return 2 * math.prod(_dims(op.outputs[0], op)) * contracted


def _convolution(op):
  """2 x (elements of the forward output) x (filter elements per output)."""
  if op.type in ("Conv2D", "DepthwiseConv2dNative"):
    out, kernel = _dims(op.outputs[0], op), _dims(op.inputs[1], op)
  elif op.type.endswith("BackpropInput"):
    out, kernel = _dims(op.inputs[2], op), _dims(op.inputs[1], op)
  else:  # BackpropFilter: the filter's gradient is the output.
    out, kernel = _dims(op.inputs[2], op), _dims(op.outputs[0], op)
  per_output = math.prod(kernel[:-1])
  if op.type.startswith("Depthwise"):
    per_output = math.prod(kernel[:2])
  return 2 * math.prod(out) * per_output


def op_flops(op):
  """FLOPs of `op` (0 for ops that are not matrix products).

  Args:
    op: a `tf.Operation` of a traced graph.

  Returns:
    An int.

  Raises:
    UnknownShape: a matrix product with a dynamic shape.

  Example:

  >>> import tensorflow as tf
  >>> graph = tf.function(tf.matmul).get_concrete_function(
  ...     tf.TensorSpec((3, 4)), tf.TensorSpec((4, 5))).graph
  >>> sum(op_flops(op) for op in graph.get_operations())  # 2 x 3 x 4 x 5
  120
  """
  if op.type == "MatMul":
    a = _dims(op.inputs[0], op)
    k = a[0] if op.get_attr("transpose_a") else a[1]
    return 2 * math.prod(_dims(op.outputs[0], op)) * k
  if op.type.startswith("BatchMatMul"):
    a = _dims(op.inputs[0], op)
    k = a[-2] if op.get_attr("adj_x") else a[-1]
    return 2 * math.prod(_dims(op.outputs[0], op)) * k
  if op.type == "Einsum":
    return _einsum(op)
  if op.type in _CONVOLUTIONS:
    return _convolution(op)
  return 0
