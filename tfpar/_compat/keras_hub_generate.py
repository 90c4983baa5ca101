"""keras-hub's `CausalLM.generate` handed to the model's strategy.

keras-hub compiles `generate_step` in `CausalLM.make_generate_function`
(a `tf.function` on TensorFlow, cached in the model's `generate_function`
until `compile` resets it) and calls it outside the strategy's replicas:
where a strategy computes layers per device (SPMD tensor parallelism), the
split layers cannot run there. The hook asks the model's strategy for the
function first (`function_for(model)`); None keeps keras-hub's.

Its `generate_step` runs the forward pass of new tokens through the
model's `call_with_cache(token_ids, cache, cache_update_index)`, whose
cache argument is `[batch, layers, 2, length, key/value heads, head dim]`
for the decoder models tfpar splits (GPT-2, Llama, Mistral, Qwen, Gemma):
`swapped_call_with_cache` replaces it for the duration of a trace.
"""

import contextlib
import functools
import inspect

from tfpar._compat.checks import Incompatible
from tfpar._compat.checks import require

# The cache argument of keras-hub's `CausalLM.call_with_cache`.
CACHE_ARGUMENT = "cache"


def install(function_for):
  """Patches `keras_hub.models.CausalLM.make_generate_function` once.

  Args:
    function_for: `function_for(model)` returns the generate function of
      `model` (`fn(inputs, stop_token_ids=None)`), or None for keras-hub's.

  Raises:
    Incompatible: keras-hub no longer has the method or the cached
      `generate_function` attribute it fills.
  """
  import keras_hub  # pylint: disable=g-import-not-at-top
  causal_lm = require(keras_hub.models, "CausalLM", "generate() per device")
  if getattr(causal_lm, "_tfpar_generate_hook", False):
    return
  original = require(causal_lm, "make_generate_function",
                     "generate() per device")
  require(causal_lm, "generate_step", "generate() per device")

  @functools.wraps(original)
  def make_generate_function(self):
    if getattr(self, "generate_function", None) is not None:
      return self.generate_function
    if not hasattr(self, "generate_function"):
      raise Incompatible(
          "tfpar caches the generate function in keras-hub's "
          "CausalLM.generate_function, which this keras-hub no longer "
          "sets; update tfpar/_compat/keras_hub_generate.py.")
    function = function_for(self)
    if function is None:
      return original(self)
    self.generate_function = function
    return function

  causal_lm.make_generate_function = make_generate_function
  causal_lm._tfpar_generate_hook = True  # pylint: disable=protected-access


def is_causal_lm(model):
  """Whether `model` is a keras-hub `CausalLM` (False when keras-hub is not
  imported)."""
  import sys  # pylint: disable=g-import-not-at-top
  hub = sys.modules.get("keras_hub")
  return hub is not None and isinstance(model, hub.models.CausalLM)


@contextlib.contextmanager
def swapped_call_with_cache(model, wrap):
  """Inside, `model.call_with_cache` is `wrap(original, bind)`, where
  `bind(*args, **kwargs)` returns the call's arguments by name.

  Raises:
    Incompatible: the model's `call_with_cache` takes no `cache` argument.
  """
  original = require(model, "call_with_cache", "generate() per device")
  signature = inspect.signature(original)
  if CACHE_ARGUMENT not in signature.parameters:
    raise Incompatible(
        f"tfpar splits the key/value cache of {type(model).__name__}."
        f"call_with_cache by its {CACHE_ARGUMENT!r} argument, which it does "
        f"not take ({signature}); update "
        f"tfpar/_compat/keras_hub_generate.py.")
  own = vars(model).get("call_with_cache")
  object.__setattr__(model, "call_with_cache",
                     wrap(original, signature.bind))
  try:
    yield
  finally:
    if own is None:
      object.__delattr__(model, "call_with_cache")
    else:
      object.__setattr__(model, "call_with_cache", own)
