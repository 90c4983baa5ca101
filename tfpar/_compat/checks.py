"""Loud failures when Keras or TensorFlow moved something tfpar relies on."""

_MISSING = object()


class Incompatible(ImportError):
  """The installed Keras, keras-hub or TensorFlow lacks an internal tfpar
  relies on. Raised instead of training unsharded."""


def versions():
  """The installed TensorFlow, Keras and keras-hub versions, as text.

  >>> "TensorFlow" in versions()
  True
  """
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    import keras_hub  # pylint: disable=g-import-not-at-top
    hub = f", keras-hub {keras_hub.__version__}"
  except ImportError:
    hub = ""
  return f"TensorFlow {tf.__version__}, Keras {keras.__version__}{hub}"


def _owner_name(owner):
  if isinstance(owner, type):
    return f"{owner.__module__}.{owner.__qualname__}"
  name = getattr(owner, "__name__", None)
  return name if name else type(owner).__name__


def require(owner, name, purpose):
  """`owner.name`, or `Incompatible` naming it, its purpose and the
  installed versions.

  Args:
    owner: a module, class or object of Keras or TensorFlow.
    name: the attribute tfpar relies on.
    purpose: what tfpar uses it for (goes into the error).

  Returns:
    The attribute's value.

  >>> import math
  >>> require(math, "pi", "a constant") > 3
  True
  >>> require(math, "tau_squared", "an example")
  Traceback (most recent call last):
  ...
  tfpar._compat.checks.Incompatible: tfpar needs math.tau_squared (an example), ...
  """
  value = getattr(owner, name, _MISSING)
  if value is _MISSING:
    raise Incompatible(
        f"tfpar needs {_owner_name(owner)}.{name} ({purpose}), which "
        f"{versions()} does not have: this version moved it. Install a "
        f"supported version (setup.cfg) or update tfpar/_compat.")
  return value


def member(obj, name, purpose, error=None):
  """`obj.name` for an attribute named by a table of tfpar's (keras-hub's
  attention projections, head counts, expert weights).

  Args:
    obj: a layer or object.
    name: the attribute.
    purpose: what tfpar uses it for.
    error: exception class to raise when it is missing (default
      `Incompatible`); plans pass `ValueError` so that a user can name
      another layout for the layer.

  Returns:
    The attribute's value.

  >>> class Layer: pass
  >>> layer = Layer(); layer.heads = 4
  >>> member(layer, "heads", "head count")
  4
  """
  value = getattr(obj, name, _MISSING)
  if value is _MISSING:
    label = getattr(obj, "name", None)
    raise (error or Incompatible)(
        f"{type(obj).__name__}{f' {label!r}' if label else ''} has no "
        f"attribute {name!r}, which tfpar relies on ({purpose}); installed: "
        f"{versions()}.")
  return value
