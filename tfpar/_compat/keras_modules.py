"""Keras's private modules tfpar uses, each checked at import for the
names tfpar calls (`Incompatible` if one moved).

Why each is needed is in docs/design.md; in short: the TensorFlow trainer
and optimizer classes tfpar hooks (fit, gradient accumulation, loss
scaling) are not exported; the pipeline's step replays the trainer's loss
bookkeeping; ZeRO and tensor parallelism create Keras variables around
distributed TensorFlow variables.
"""

# pylint: disable=unused-import
from keras.src import backend
from keras.src import ops as keras_ops
from keras.src import tree
from keras.src.backend.common import symbolic_scope
from keras.src.backend.common import tensor_attributes
from keras.src.backend.common import variables as keras_variables
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.distribution import distribution_lib
from keras.src.losses import loss as loss_module
from keras.src.optimizers import base_optimizer
from keras.src.optimizers import loss_scale_optimizer
from keras.src.trainers import data_adapters
from keras.src.utils import tracking as keras_tracking

from tfpar._compat.checks import require

_NEEDED = {
    backend: ("Variable", "get_keras_mask", "set_keras_mask"),
    keras_ops.numpy: ("Add", "Subtract", "Multiply"),
    tree: ("flatten", "map_structure"),
    tensor_attributes: ("get_tensor_attr", "set_tensor_attr"),
    keras_variables: ("AutocastScope", "get_autocast_scope"),
    tf_optimizer: ("TFOptimizer",),
    tf_trainer: ("TensorFlowTrainer",),
    distribution_lib: ("DataParallel", "ModelParallel", "set_distribution"),
    loss_module: ("unscale_loss_for_distribution",),
    base_optimizer: ("clip_by_global_norm",),
    loss_scale_optimizer: ("LossScaleOptimizer",),
    data_adapters: ("data_adapter_utils",),
    symbolic_scope: ("in_symbolic_scope",),
    keras_tracking: ("DotNotTrackScope",),
}
for _module, _names in _NEEDED.items():
  for _name in _names:
    require(_module, _name, "tfpar's Keras integration")
require(data_adapters.data_adapter_utils, "unpack_x_y_sample_weight",
        "the pipeline's step")

unpack_x_y_sample_weight = (
    data_adapters.data_adapter_utils.unpack_x_y_sample_weight)
