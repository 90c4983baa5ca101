"""Running a replica function once per device of every tensor group (the
SPMD execution of tensor, pipeline and expert parallelism, `engine/per_device/`).

TensorFlow's mirrored machinery runs one thread per replica device and
gives each a replica context whose id picks the replica's component of
every distributed value. Under SPMD a data replica spans a tensor group
and the function is traced once per device of it: `run_on_devices` runs
the threads over all `data x tensor` devices (the loop of
`mirrored_run._call_for_each_replica`, with the device list given), and
each thread's replica id is a `DeviceReplicaId`: the data replica it
belongs to (what `replica_id_in_sync_group` reports, so Keras and user
code see `data` replicas), carrying the device's index among the
components of variables (what `_get_local_replica_id` hands TensorFlow).

Also here: reading a replica context's id, telling Keras's shape
inference (`in_symbolic_scope`) from computation, and running a
Functional model's graph operation by operation (`_run_through_graph`,
for sequence parallelism).
"""

import threading

from tensorflow.python.autograph.core import ag_ctx as autograph_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import mirrored_run
from tensorflow.python.distribute import shared_variable_creator
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops import variable_scope
from tensorflow.python.training import coordinator

from tfpar._compat import side_effects as side_effects_lib
from tfpar._compat.checks import require

_THREAD = require(mirrored_run, "_MirroredReplicaThread",
                  "one replica thread per device")
_STOP = require(mirrored_run, "_RequestedStop", "one replica thread per device")
_LOCAL_CALLABLES = require(mirrored_run,
                           "_get_thread_local_configuration_callable",
                           "one replica thread per device")
require(_THREAD, "run", "one replica thread per device")


class DeviceReplicaId(int):
  """A replica id (the data replica) that knows which device of the
  replica's tensor group its thread traces.

  Args:
    replica: the data replica id in sync group.
    device_index: the device's index among this worker's data x tensor
      devices (the component index of variables).
    tensor_index: the device's index in its tensor group.
  """

  def __new__(cls, replica, device_index, tensor_index):
    value = super().__new__(cls, replica)
    value.device_index = device_index
    value.tensor_index = tensor_index
    return value


class DeviceReplicaIds:
  """Mixin of an extended whose replica contexts may carry a
  `DeviceReplicaId`: their local replica id is the device's index."""

  def _get_local_replica_id(self, replica_id_in_sync_group):
    if isinstance(replica_id_in_sync_group, DeviceReplicaId):
      return replica_id_in_sync_group.device_index
    return super()._get_local_replica_id(replica_id_in_sync_group)


def traceable(fn):
  """The Python function to trace once per device: a `tf.function`'s own
  function (we are inside the step's trace already), autograph-converted
  as `mirrored_run.call_for_each_replica` converts it."""
  python_function = getattr(fn, "python_function", None)
  if python_function is not None:
    return python_function
  return autograph.tf_convert(fn, autograph_ctx.control_status_ctx())


def run_on_devices(distribution, fn, args, kwargs, devices, replica_ids):
  """Runs `fn` once per device, each in its own replica thread.

  Args:
    distribution: the strategy.
    fn: the replica function (traced: graph mode only).
    args: positional arguments, distributed values with one component per
      device.
    kwargs: keyword arguments, the same.
    devices: the devices, in the order of the components.
    replica_ids: a `DeviceReplicaId` per device.

  Returns:
    `fn`'s results regrouped over the devices (one component each).
  """
  ops.get_default_graph().switch_to_thread_local()
  coord = coordinator.Coordinator(clean_stop_exception_types=(_STOP,))
  shared_variable_store = {}
  local_callables = _LOCAL_CALLABLES()
  threads = []
  for index in range(len(devices)):
    creator = shared_variable_creator.make_fn(shared_variable_store, index)
    thread = _THREAD(distribution, coord, index, devices, creator, fn,
                     distribute_utils.caching_scope_local,
                     distribute_utils.select_replica(index, args),
                     distribute_utils.select_replica(index, kwargs),
                     local_callables)
    thread.replica_id_in_sync_group = replica_ids[index]
    threads.append(thread)
  for thread in threads:
    thread.start()
  side_effects = side_effects_lib.SideEffects(ops.get_default_graph(),
                                              len(threads))
  # As mirrored_run._call_for_each_replica: run each thread to its next
  # merge_call (or its end), then run the merge function on the main thread.
  try:
    with coord.stop_on_exception():
      all_done = False
      while not all_done and not coord.should_stop():
        done = []
        for index, thread in enumerate(threads):
          side_effects.start()
          thread.should_run.set()
          thread.has_paused.wait()
          thread.has_paused.clear()
          side_effects.end(index)
          if coord.should_stop():
            return None
          done.append(thread.done)
        if coord.should_stop():
          return None
        all_done = all(done)
        if not all_done:
          if any(done):
            raise RuntimeError("Some replicas made a different number of "
                               "replica_context().merge_call() calls.")
          merge_args = distribute_utils.regroup(
              tuple(t.merge_args for t in threads))
          merge_kwargs = distribute_utils.regroup(
              tuple(t.merge_kwargs for t in threads))
          deps = set()
          for thread in threads:
            deps.update(thread.captured_control_deps)
          first = threads[0]
          eager = getattr(first, "merge_call_entered_in_eager", False)
          with ops.name_scope(first.captured_name_scope), \
              ops.control_dependencies(deps), \
              variable_scope.variable_scope(first.captured_var_scope), \
              (context.eager_mode() if eager else _nothing()):
            merge_result = first.merge_fn(distribution, *merge_args,
                                          **merge_kwargs)
          for index, thread in enumerate(threads):
            thread.merge_result = distribute_utils.select_replica(
                index, merge_result)
  finally:
    for thread in threads:
      thread.should_run.set()
    coord.join(threads)
  side_effects.order_per_device()
  return distribute_utils.regroup(tuple(t.main_result for t in threads))


class _nothing:  # pylint: disable=invalid-name
  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    return False


def current_thread_is_replica():
  """Whether this thread is a replica thread of `run_on_devices`."""
  return isinstance(threading.current_thread(), _THREAD)


def device_replica_id(replica_context):
  """The `DeviceReplicaId` of an SPMD replica context, or None."""
  if replica_context is None:
    return None
  replica = require(replica_context, "_replica_id_in_sync_group",
                    "the device a replica thread traces")
  return replica if isinstance(replica, DeviceReplicaId) else None


def in_symbolic_trace():
  """Whether Keras is tracing a layer for shapes only
  (`backend.compute_output_spec`), not computing."""
  from keras.src.backend.common import symbolic_scope  # pylint: disable=g-import-not-at-top
  return require(symbolic_scope, "in_symbolic_scope",
                 "telling shape inference from computation")()


def wrap_graph_run(model, wrap, finish):
  """Makes a Functional (or Sequential) model run each operation of its
  graph through `wrap(operation, call)` (the call to make) and pass its
  outputs through `finish(outputs)`. Returns False when the model has no
  graph to run."""
  from tfpar._compat import keras_layers  # pylint: disable=g-import-not-at-top
  graph_model = keras_layers.functional_graph(model) or model
  if getattr(graph_model, "_tfpar_spmd_graph_run", False):
    return True  # A Sequential and its graph: once.
  if not hasattr(graph_model, "_nodes_by_depth"):  # No graph (subclassed).
    return False
  original = require(graph_model, "_run_through_graph",
                     "running a model's graph operation by operation")

  def run_through_graph(inputs, operation_fn=lambda op: op, call_fn=None):
    return finish(original(inputs, lambda operation: wrap(
        operation, operation_fn(operation)), call_fn))

  object.__setattr__(graph_model, "_run_through_graph", run_through_graph)
  object.__setattr__(graph_model, "_tfpar_spmd_graph_run", True)
  return True
