"""The `tfpar` command line."""

import argparse
import sys

from tfpar import launch as launch_lib


def build_parser():
  """The argument parser of the `tfpar` command."""
  parser = argparse.ArgumentParser(
      prog="tfpar", description="Parallel training for TensorFlow / Keras 3.")
  commands = parser.add_subparsers(dest="command", required=True)
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
  launch.add_argument("--module", "-m", action="store_true",
                      help="SCRIPT is a module name, run as python -m SCRIPT")
  launch.add_argument("script", help="the Python script (or module) to run")
  launch.add_argument("args", nargs=argparse.REMAINDER,
                      help="arguments passed to the script")
  return parser


def main(argv=None):
  """Entry point of the `tfpar` console script; returns the exit code."""
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command == "launch":
    command = ([sys.executable, "-m", args.script] if args.module
               else [sys.executable, args.script]) + list(args.args)
    try:
      config = launch_lib.LaunchConfig(
          tuple(command), workers=args.workers,
          devices_per_worker=args.devices_per_worker, host=args.host,
          timeout=args.timeout, isolate_network=args.isolate_network)
    except ValueError as e:
      parser.error(str(e))
    return launch_lib.launch(config)
  parser.error(f"unknown command {args.command!r}")
  return 2


if __name__ == "__main__":
  sys.exit(main())
