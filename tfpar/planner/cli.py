"""`tfpar plan`: the memory planner on the command line.

Importing this module does not import TensorFlow, so `tfpar --help` and
`tfpar launch` stay fast; `run` imports it only to load a `--model`, and
leaves TensorFlow's start-up log out of its output (`tf_startup_log`).
"""

import importlib
import os
import sys

from tfpar import tf_startup_log

_DESCRIPTION = (
    "Estimates the memory per device of parameters, gradients, optimizer "
    "state and activations for every layout of a model on DEVICES devices "
    "(data parallel, ZeRO 1/2/3, CPU offload, tensor, pipeline, recompute, "
    "3D, and expert parallelism for mixture-of-experts models), prints them as a table and recommends the fastest layout that "
    "fits. Give the model as --model module:function (a function returning "
    "a built Keras model), --model file.keras, or --parameters COUNT for the "
    "model states alone.")


def add_parser(subcommands):
  """Adds the `plan` subcommand to an argparse subparsers object.

  Args:
    subcommands: what `ArgumentParser.add_subparsers()` returned.

  Returns:
    The `plan` parser.

  Example:

  >>> import argparse
  >>> from tfpar.planner import cli
  >>> parser = argparse.ArgumentParser(prog="tfpar")
  >>> _ = cli.add_parser(parser.add_subparsers(dest="command"))
  >>> parser.parse_args(["plan", "--parameters", "7.5e9", "--devices", "64",
  ...                    "--memory-per-device", "32GB"]).devices
  64
  """
  parser = subcommands.add_parser(
      "plan", help="memory per device of each parallel layout, and which "
      "to use", description=_DESCRIPTION)
  model = parser.add_mutually_exclusive_group(required=True)
  model.add_argument("--model", help="module:function returning a built "
                     "Keras model, or a .keras file")
  model.add_argument("--parameters", type=float, help="parameter count for "
                     "a model-free estimate, e.g. 7.5e9")
  parser.add_argument("--devices", type=int, required=True,
                      help="number of devices N")
  parser.add_argument("--memory-per-device", required=True,
                      help="memory of each device, e.g. 16GB or 40GiB")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="global batch (default: one sample per device)")
  parser.add_argument("--precision", default="fp32",
                      help="fp32 (Keras default), mixed (fp16 weights and "
                      "gradients, fp32 Adam state, as in the ZeRO paper), or "
                      "a Keras policy: mixed_float16 or mixed_bfloat16 "
                      "(float32 weights, 2-byte activations)")
  parser.add_argument("--optimizer", default=None,
                      help="optimizer name, e.g. adam or sgd (default: the "
                      "model's, else adam)")
  parser.add_argument("--gradient-accumulation-steps", type=int,
                      default=None, metavar="K",
                      help="the optimizer's gradient_accumulation_steps: "
                      "counts Keras's gradient accumulators (default: the "
                      "model's optimizer's, else none)")
  parser.add_argument("--node-size", type=int, default=None,
                      help="devices per node: the largest tensor degree "
                      "(default: min(N, 8))")
  parser.add_argument("--microbatches", type=int, default=None,
                      help="micro-batches per pipeline batch (default 4p)")
  parser.add_argument("--schedule", default="1f1b",
                      help="pipeline schedule: 1f1b or gpipe")
  parser.add_argument("--all", action="store_true",
                      help="list every candidate, not just the readable set")
  parser.add_argument("--plot", metavar="PNG", default=None,
                      help="also draw the memory bar chart to this PNG file")
  parser.add_argument("--write-recipe", metavar="TOML", default=None,
                      help="also write the recommended layout as a recipe "
                      "file for `tfpar launch --recipe TOML`")
  return parser


def load_model(spec):
  """A built Keras model from "module:function" or a saved model file.

  Args:
    spec: "package.module:function" (the function returns a built Keras
      model; the working directory is importable) or a path to a .keras
      or .h5 file.

  Raises:
    ValueError: the spec names nothing loadable.

  Example:

  >>> from tfpar.planner.cli import load_model
  >>> load_model("keras.applications:MobileNetV3Small").name  # doctest: +SKIP
  'MobileNetV3Small'
  """
  import keras  # pylint: disable=g-import-not-at-top
  if os.path.exists(spec):
    try:
      return keras.saving.load_model(spec)
    except Exception:  # pylint: disable=broad-except
      return keras.saving.load_model(spec, compile=False)
  module_name, _, function_name = spec.partition(":")
  if not module_name or not function_name:
    raise ValueError(
        f"--model must be module:function (a function returning a built "
        f"Keras model) or an existing .keras file. Received: --model={spec!r}.")
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except ImportError as error:
    raise ValueError(f"--model {spec!r}: cannot import {module_name!r} "
                     f"({error}).") from None
  function = getattr(module, function_name, None)
  if not callable(function):
    raise ValueError(f"--model {spec!r}: module {module_name!r} has no "
                     f"function {function_name!r}.")
  model = function()
  if not isinstance(model, keras.Model):
    raise ValueError(f"--model {spec!r} returned {type(model).__name__}, "
                     f"not a Keras model.")
  return model


def run(args):
  """Runs `tfpar plan` with parsed arguments; returns the exit code.

  0 when a layout fits, 1 when none does, 2 for bad arguments.

  Args:
    args: the `argparse.Namespace` of the `plan` parser.

  Example:

  >>> import argparse
  >>> from tfpar.planner import cli
  >>> parser = argparse.ArgumentParser(prog="tfpar")
  >>> _ = cli.add_parser(parser.add_subparsers(dest="command"))
  >>> cli.run(parser.parse_args([
  ...     "plan", "--parameters", "7.5e9", "--devices", "64",
  ...     "--memory-per-device", "32GB", "--precision", "mixed"]))  # doctest: +SKIP
  0
  """
  from tfpar.planner import api  # pylint: disable=g-import-not-at-top
  try:
    if args.parameters is not None:
      model = args.parameters
    else:  # Starts TensorFlow.
      with tf_startup_log.filtered_stderr():
        model = load_model(args.model)
    result = api.plan(
        model, args.devices, args.memory_per_device,
        batch_size=args.batch_size, precision=args.precision,
        optimizer=args.optimizer, node_size=args.node_size,
        num_microbatches=args.microbatches, schedule=args.schedule,
        gradient_accumulation_steps=args.gradient_accumulation_steps)
  except ValueError as error:
    print(f"tfpar plan: error: {error}", file=sys.stderr)
    return 2
  print(result.table(all_candidates=args.all))
  print()
  print(result.reason)
  if result.notes:
    print("\nNotes:")
    for note in result.notes:
      print(f"- {note}")
  if args.plot:
    result.plot(args.plot, all_candidates=args.all)
    print(f"\nWrote the memory chart to {args.plot}")
  if args.write_recipe and result.recommended is not None:
    result.write_recipe(args.write_recipe)
    print(f"\nWrote the recommended layout to {args.write_recipe}: run it "
          f"with tfpar launch --recipe {args.write_recipe} train.py")
  return 0 if result.recommended is not None else 1
