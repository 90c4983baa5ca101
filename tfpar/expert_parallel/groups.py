"""Expert groups: how expert parallelism divides the `data` axis.

As in DeepSpeed-MoE and Megatron-Core, the expert group is carved out of
the data-parallel replicas, so the mesh keeps its three axes:

* expert group g: the `expert` consecutive data replicas
  `g * expert ... (g + 1) * expert - 1`. Their tokens are exchanged with
  all-to-alls; together they hold every expert of each MoE layer, replica
  with expert rank j holding experts `j * E / expert ... (j + 1) * E / expert - 1`.
* expert-data group j: the `data / expert` replicas of expert rank j, one
  per expert group. They hold the same experts, and those experts'
  gradients are summed over them (instead of over every replica).

Everything else (attention, embeddings, the router) stays data-parallel:
one copy per replica, gradients summed over all replicas.

Under expert x tensor (a mesh with a tensor axis of size t) the groups are
the same replicas; the k-th device of each replica holds E / (expert * t)
of its rank's experts, and has its own expert-data group: the k-th devices
of the replicas of its rank.
"""

import dataclasses

import tensorflow as tf

from tfpar import engine
from tfpar._compat import traced_keys
from tfpar._compat.tf_modules import collective_util
from tfpar._compat.tf_modules import cross_device_utils


def check_expert_size(expert, data):
  """Raises unless `expert` is a positive integer that divides `data`.

  Args:
    expert: the requested expert-group size.
    data: the mesh's data size.

  Example:

  >>> check_expert_size(2, 4)
  >>> check_expert_size(3, 4)
  Traceback (most recent call last):
  ...
  ValueError: expert=3 does not divide the mesh's data size 4: the expert group is carved out of the data replicas, so expert must be one of [1, 2, 4].
  """
  if isinstance(expert, bool) or not isinstance(expert, int) or expert < 1:
    raise ValueError(f"expert must be a positive integer (the number of data "
                     f"replicas an MoE layer's experts are split over). "
                     f"Received: expert={expert!r}")
  if data % expert:
    fits = [n for n in range(1, data + 1) if data % n == 0]
    raise ValueError(
        f"expert={expert} does not divide the mesh's data size {data}: the "
        f"expert group is carved out of the data replicas, so expert must be "
        f"one of {fits}.")


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
  """Which replicas exchange tokens and which share experts.

  Attributes:
    data: the number of data replicas.
    expert: the expert-group size.

  Example:

  >>> groups = ExpertGroups(data=4, expert=2)
  >>> groups.expert_group(3), groups.expert_rank(3)
  ((2, 3), 1)
  >>> groups.expert_data_group(1)
  (1, 3)
  """
  data: int
  expert: int

  def __post_init__(self):
    check_expert_size(self.expert, self.data)

  def expert_group(self, replica):
    """The replicas whose tokens meet in all-to-alls with `replica`'s."""
    first = replica - replica % self.expert
    return tuple(range(first, first + self.expert))

  def expert_rank(self, replica):
    """The index of `replica` within its expert group (which experts it
    holds)."""
    return replica % self.expert

  def expert_data_group(self, replica):
    """The replicas holding the same experts as `replica`."""
    return tuple(range(self.expert_rank(replica), self.data, self.expert))

  @property
  def num_expert_groups(self):
    return self.data // self.expert


class Launchers:
  """Collective launchers of one strategy's expert and expert-data groups,
  with keys of their own (`tfpar.engine.next_collective_key_base`).

  Args:
    groups: the `ExpertGroups`.
    replicas: every replica's device group, in replica order (global); the
      tokens meet on the first device of each (its head).
    local_replicas: the global ids of this worker's replicas.
    options: `tf.distribute.experimental.CommunicationOptions`.
    columns: the devices of a replica that hold experts (1: its head; the
      tensor size under expert x tensor, where column k of every replica
      holds its own experts and has its own expert-data groups; the
      pipeline size under expert x pipeline, stage s's experts on column s).
    token_columns: the devices of a replica whose tokens meet in
      all-to-alls (and whose router statistics are summed): its head, or
      under expert x pipeline each stage's device.
  """

  def __init__(self, groups, replicas, local_replicas, options=None,
               columns=1, token_columns=(0,)):
    self._groups = groups
    heads = [group[0] for group in replicas]
    keys = cross_device_utils.CollectiveKeys(
        group_key_start=1 + engine.next_collective_key_base())
    options = options or collective_util.Options()
    # Keys are numbered in the order groups are first seen: every worker
    # numbers every group, in replica order, so that a group has the same
    # key on each of its members' workers (numbering only its own groups,
    # worker 1's first expert group took worker 0's key).
    keys.get_group_key(list(heads))
    for group_of in (groups.expert_group, groups.expert_data_group):
      for replica in range(groups.data):
        keys.get_group_key([heads[r] for r in group_of(replica)])
    for column in range(1, columns):
      for replica in range(groups.data):
        keys.get_group_key([replicas[r][column]
                            for r in groups.expert_data_group(replica)])
    for column in token_columns:  # After the heads' (column 0) groups.
      if column:
        keys.get_group_key([group[column] for group in replicas])
        for replica in range(groups.data):
          keys.get_group_key([replicas[r][column]
                              for r in groups.expert_group(replica)])
    self._all_to_all = {}
    self._expert_data = {}
    self._everyone = {}
    for column in token_columns:
      everyone = [group[column] for group in replicas]
      for replica in local_replicas:
        self._everyone[replica, column] = (
            cross_device_utils.CollectiveReplicaLauncher(
                keys.get_group_key(everyone), len(everyone), keys,
                replicas[replica][column], options))
      for replica in local_replicas:
        devices = [replicas[r][column] for r in groups.expert_group(replica)]
        _check_rank_order(devices)
        self._all_to_all[replica, column] = (
            cross_device_utils.CollectiveReplicaLauncher(
                keys.get_group_key(devices), len(devices), keys,
                replicas[replica][column], options))
    for column in range(columns):
      for replica in local_replicas:
        devices = [replicas[r][column]
                   for r in groups.expert_data_group(replica)]
        self._expert_data[replica, column] = (
            cross_device_utils.CollectiveReplicaLauncher(
                keys.get_group_key(devices), len(devices), keys,
                replicas[replica][column], options))
    if len(local_replicas) == len(replicas):  # One process.
      traced_keys.draw_keys_when_traced(
          [*self._everyone.values(), *self._all_to_all.values(),
           *self._expert_data.values()])

  def all_to_all(self, replica, column=0):
    """The launcher of `replica`'s expert group (among the replicas'
    devices `column`)."""
    return self._all_to_all[replica, column]

  def everyone(self, replica, column=0):
    """The launcher of the group of every replica (their devices
    `column`)."""
    return self._everyone[replica, column]

  def expert_data(self, replica, column=0):
    """The launcher of `replica`'s expert-data group (on the replica's
    device `column`)."""
    return self._expert_data[replica, column]


def _check_rank_order(devices):
  # A collective ranks its members by device name (task, then device
  # index); token chunk j goes to rank j, which must be expert rank j.
  specs = [tf.DeviceSpec.from_string(d) for d in devices]
  keys = [(s.job or "", s.replica or 0, s.task or 0, s.device_type or "",
           s.device_index or 0) for s in specs]
  if keys != sorted(keys):
    raise ValueError(
        f"The replicas of an expert group must be ordered as their devices "
        f"are ranked by TensorFlow's collectives (by task, then device "
        f"index). Received the group {devices}; build the mesh from devices "
        f"in their natural order.")
