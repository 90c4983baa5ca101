"""Finding a built layer's variables and freeing their creation-time
slices once they are split (`spmd/weights.py` splits them)."""

from tfpar._compat import keras_layers


def owners_of(layer):
  """{variable path: (owning layer, variable)} inside `layer`."""
  owners = {}
  for sub in keras_layers.flatten_layers(layer, include_self=True):
    for variable in keras_layers.own_variables(sub):
      owners[variable.path] = (sub, variable)
  return owners


def release_spread(variable):
  """Frees the creation-time slices of a weight now held as shards."""
  storage = keras_layers.storage(variable)
  if hasattr(storage, "release"):
    storage.release()
