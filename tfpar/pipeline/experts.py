"""What expert x pipeline (`PipelineParallelStrategy(expert=...)`) accepts,
checked before any work."""

from tfpar.expert_parallel import groups as groups_lib
from tfpar.expert_parallel import routing


def check_options(expert, capacity_factor, schedule, recompute):
  """Raises for settings expert x pipeline does not run.

  Args:
    expert: None, or the expert-group size.
    capacity_factor: None or a positive number (only with `expert`).
    schedule: the pipeline schedule's name.
    recompute: whether stages are recomputed in the backward.

  Example:

  >>> check_options(2, None, "1f1b", False)
  >>> check_options(None, 1.0, "1f1b", False)
  Traceback (most recent call last):
  ...
  ValueError: capacity_factor=1.0 bounds the tokens of split experts; set expert= too (expert=None leaves every MoE layer whole on its stage).
  """
  if expert is None:
    if capacity_factor is not None:
      raise ValueError(
          f"capacity_factor={capacity_factor!r} bounds the tokens of split "
          f"experts; set expert= too (expert=None leaves every MoE layer "
          f"whole on its stage).")
    return
  if isinstance(expert, bool) or not isinstance(expert, int) or expert < 1:
    raise ValueError(f"expert must be None or a positive integer (the data "
                     f"replicas each stage's experts are split over). "
                     f"Received: expert={expert!r}")
  routing.check_capacity_factor(capacity_factor)
  if schedule == "interleaved":
    raise ValueError(
        f"expert={expert} runs with schedule='1f1b' or 'gpipe'; "
        f"schedule='interleaved' with split experts is not supported yet.")
  if recompute:
    raise ValueError(
        f"expert={expert} does not combine with recompute=True yet (a "
        f"recomputed stage would route its tokens and count them twice).")


def check_mesh(mesh, expert):
  """Raises unless `mesh` is a one-worker data x pipeline mesh whose data
  size `expert` divides.

  Example:

  >>> import tfpar
  >>> mesh = tfpar.Mesh({"data": 1, "pipeline": 2}, devices=["/CPU:0", "/CPU:1"])
  >>> check_mesh(mesh, 1)
  >>> check_mesh(mesh, 2)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  ValueError: expert=2 does not divide the mesh's data size 1: ...
  """
  if mesh.shape["tensor"] > 1:
    raise ValueError(
        f"expert={expert} with a tensor axis (tensor={mesh.shape['tensor']}) "
        f"is not supported on a pipeline yet: use a data x pipeline mesh, or "
        f"tfpar.ExpertParallelStrategy for expert x tensor.")
  if mesh.is_multi_worker:
    raise ValueError(
        f"expert={expert} on a pipeline runs inside one worker for now; the "
        f"mesh spans {mesh.num_workers} workers. Use "
        f"tfpar.ExpertParallelStrategy across workers.")
  groups_lib.check_expert_size(expert, mesh.num_replicas)
