"""The `tfpar` command line.

Each subcommand is added by one `_add_<command>(commands)` call in
`build_parser`, and runs through the function it sets as `run`.
"""

import argparse
import importlib.util
import os
import sys

from tfpar import launch as launch_lib
from tfpar.planner import cli as planner_cli


def build_parser():
  """The argument parser of the `tfpar` command.

  Example:

  >>> args = build_parser().parse_args(["launch", "--recipe", "zero2", "t.py"])
  >>> args.command, args.recipe, args.script
  ('launch', 'zero2', 't.py')
  """
  parser = argparse.ArgumentParser(
      prog="tfpar", description="Parallel training for TensorFlow / Keras 3.")
  commands = parser.add_subparsers(dest="command", required=True)
  _add_launch(commands)
  _add_plan(commands)
  _add_monitor(commands)
  return parser


def _add_plan(commands):
  planner_cli.add_parser(commands).set_defaults(
      run=lambda parser, args: planner_cli.run(args))


def _add_monitor(commands):
  monitor = commands.add_parser(
      "monitor", help="tfpar.TrainingMonitor's records",
      description="Works with the CSV files tfpar.TrainingMonitor writes.")
  actions = monitor.add_subparsers(dest="action", required=True)
  plot = actions.add_parser(
      "plot", help="throughput, MFU and bus bandwidth over steps, as a PNG",
      description="Draws a TrainingMonitor CSV to a PNG (matplotlib if "
      "installed, else tfpar's own bitmap drawing).")
  plot.add_argument("csv", help="the CSV file TrainingMonitor(csv_path=) "
                    "wrote")
  plot.add_argument("--output", "-o", default=None,
                    help="the PNG to write (default: the CSV's name with "
                    ".png)")
  plot.set_defaults(run=_run_monitor_plot)


def _run_monitor_plot(parser, args):
  from tfpar.monitor import plot  # pylint: disable=g-import-not-at-top
  output = args.output or os.path.splitext(args.csv)[0] + ".png"
  if not os.path.isfile(args.csv):
    parser.error(f"the CSV file {args.csv!r} does not exist.")
  try:
    how = plot.write_png(args.csv, output)
  except ValueError as e:
    parser.error(str(e))
  print(f"wrote {output} ({how})")
  return 0


def _add_launch(commands):
  launch = commands.add_parser(
      "launch", help="run a script as several local TF_CONFIG workers",
      description="Runs SCRIPT once per worker with TF_CONFIG set, on free "
      "loopback ports, and streams the output with a prefix per worker.")
  launch.add_argument("--workers", type=int, default=2,
                      help="number of worker processes (default 2)")
  launch.add_argument("--devices-per-worker", type=int, default=None,
                      help="virtual CPU devices per worker on a CPU-only host")
  launch.add_argument("--timeout", type=float, default=None,
                      help="stop every worker after this many seconds")
  launch.add_argument("--host", default="127.0.0.1",
                      help="address the workers use (default 127.0.0.1)")
  launch.add_argument("--no-isolate-network", dest="isolate_network",
                      action="store_false", default=None,
                      help="do not run the workers in a private loopback-only "
                      "network namespace")
  launch.add_argument("--recipe", default=None, metavar="NAME",
                      help="a recipe of strategies/ (or a .toml path) that "
                      "tfpar.from_recipe() builds in the workers")
  launch.add_argument("--module", "-m", action="store_true",
                      help="SCRIPT is a module name, run as python -m SCRIPT")
  launch.add_argument("--elastic", action="store_true",
                      help="when a worker is lost, stop the others and "
                      "restart the job on the workers left, from its last "
                      "backup (tfpar.BackupAndRestore)")
  launch.add_argument("--min-workers", type=int, default=None,
                      help="with --elastic: give up when fewer workers "
                      "would be left (default 1)")
  launch.add_argument("--max-restarts", type=int, default=None,
                      help="with --elastic: give up after this many restarts "
                      "(default 3)")
  launch.add_argument("script", help="the Python script (or module) to run")
  launch.add_argument("args", nargs=argparse.REMAINDER,
                      help="arguments passed to the script")
  launch.set_defaults(run=_run_launch)


def _run_launch(parser, args):
  command = ([sys.executable, "-m", args.script] if args.module
             else [sys.executable, args.script]) + list(args.args)
  try:
    config = launch_lib.LaunchConfig(
        tuple(command), workers=args.workers,
        devices_per_worker=args.devices_per_worker, host=args.host,
        timeout=args.timeout, isolate_network=args.isolate_network,
        recipe=args.recipe, elastic=args.elastic,
        min_workers=args.min_workers, max_restarts=args.max_restarts)
  except ValueError as e:
    parser.error(str(e))
  if not args.module and not os.path.isfile(args.script):
    parser.error(f"the script {args.script!r} does not exist (checked "
                 f"before starting any worker).")
  if args.module and not _module_exists(args.script):
    parser.error(f"the module {args.script!r} (--module) is not importable "
                 f"here (checked before starting any worker).")
  return launch_lib.launch(config)


def _module_exists(name):
  # Only the top-level package is looked up: finding a submodule would
  # import its parents (perhaps TensorFlow) in the launcher.
  top = name.partition(".")[0]
  try:
    return bool(top) and importlib.util.find_spec(top) is not None
  except (ImportError, ValueError):
    return False


def main(argv=None):
  """Entry point of the `tfpar` console script; returns the exit code.

  Args:
    argv: the arguments after `tfpar` (default: `sys.argv[1:]`).

  Example:

  >>> main(["launch", "--workers", "1", "--no-isolate-network", "-m",
  ...       "this"])  # doctest: +SKIP
  0
  """
  parser = build_parser()
  args = parser.parse_args(argv)
  return args.run(parser, args)


if __name__ == "__main__":
  sys.exit(main())
