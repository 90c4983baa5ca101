"""The fence around Keras and TensorFlow internals.

This package is the only tfpar code that imports `keras.src`,
`tensorflow.python` or TensorFlow's protos, or touches a private attribute
of a Keras, keras-hub or TensorFlow object (tests/test_fence.py enforces
it). Each accessor checks what it relies on and raises `Incompatible`,
naming the installed versions and what moved, instead of letting tfpar
fall back to training unsharded. docs/design.md lists every touch point
and why it is needed.

Modules:
  checks: `Incompatible`, `require`, `member`, `versions`.
  tf_modules: TensorFlow's private modules tfpar uses.
  keras_modules: Keras's private modules tfpar uses.
  distribute: private state of tf.distribute strategies and launchers.
  traced_keys: collectives' instance keys fixed when a step is traced.
  runtime: TensorFlow's eager context, datasets, ops and TPU resolvers.
  checkpointing: per-object overrides of TensorFlow's checkpoint hooks.
  keras_layers: Keras layers', models' and variables' private state.
  keras_graph: a Functional graph with its nested models inlined.
  keras_weights_view: a layer's `weights` listing whole weights (class swap).
  keras_attention: the private parts of keras.layers.MultiHeadAttention.
  keras_optimizers: Keras optimizers' private state and update hooks.
  keras_trainer: Keras's TensorFlow trainer (step, loss, strategy).
  keras_callbacks: the save step of Keras's checkpoint callbacks.
  keras_distribution_parts: a ModelParallel's layout map.
  keras_hub_names: keras-hub's private attribute names tfpar reads.
  keras_hub_blocks: keras-hub blocks' attention masks (sequence slices).
  keras_hub_generate: keras-hub's CausalLM.generate handed to the strategy.
  graph_functions: the function graphs a traced op calls (tfpar.monitor).
  custom_gradients: traced custom gradients released with their graph.
"""

from tfpar._compat.checks import Incompatible
from tfpar._compat.checks import member
from tfpar._compat.checks import require
from tfpar._compat.checks import versions

__all__ = ["Incompatible", "member", "require", "versions"]
