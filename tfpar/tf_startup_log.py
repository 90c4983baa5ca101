"""TensorFlow's start-up log, which tfpar's command-line tools leave out.

TensorFlow's native libraries print a dozen lines when they load and start
(oneDNN's notice, the CPU instructions the build does not use, no CUDA
driver found, the coordination service's and gRPC server's progress), and
`TF_CPP_MIN_LOG_LEVEL` no longer silences them: they go out before
TensorFlow reads it. `tfpar launch` drops them from its workers' output and
says how many it dropped; `tfpar plan --model` drops them from its own.
`TFPAR_TF_LOGS=1` keeps every line.

Left out: TensorFlow's INFO lines (native, and its Python logger's
`INFO:tensorflow:` lines), absl's banner before them, and two warnings
that say nothing about the user's job (no CUDA driver on a CPU machine;
Keras's Python-generator input "will not be optimized"). Every other
warning and error stays.

No TensorFlow here: the launcher must start fast.
"""

import contextlib
import os
import re
import sys
import tempfile
import threading

SHOW_ENV = "TFPAR_TF_LOGS"

# absl's format: severity, MMDD, time, thread id, file:line] message.
_NATIVE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([\w.+-]+):\d+\] (.*)$")
_NOISE_PREFIXES = (
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    # The second line of cpu_feature_guard.cc's INFO message.
    "To enable the following instructions:",
    "INFO:tensorflow:",  # TensorFlow's Python logger.
)
_QUIET_WARNINGS = (
    ("cuda_platform.cc", "failed call to cuInit"),
    ("dataset.cc", "will not be optimized because the dataset does not "
     "implement the AsGraphDefInternal()"),
)


def shown():
  """Whether the user asked for TensorFlow's whole log (`TFPAR_TF_LOGS=1`)."""
  return os.environ.get(SHOW_ENV, "") not in ("", "0")


def is_startup_noise(line):
  """Whether `line` (one line of a process's output) is TensorFlow start-up
  noise that tfpar's tools leave out.

  Args:
    line: the line, without its newline.

  Example:

  >>> from tfpar.tf_startup_log import is_startup_noise
  >>> is_startup_noise("I0000 00:00:1796031355.9 2 port.cc:153] oneDNN "
  ...                  "custom operations are on.")
  True
  >>> is_startup_noise("E0000 00:00:1796031355.9 2 ring_reducer.cc:90] "
  ...                  "Collective timed out")
  False
  >>> is_startup_noise("INFO:tensorflow:Check health not enabled.")
  True
  >>> is_startup_noise("Epoch 1/3")
  False
  """
  if line.startswith(_NOISE_PREFIXES):
    return True
  native = _NATIVE.match(line)
  if native is None:
    return False
  severity, source, message = native.groups()
  if severity == "I":
    return True
  return any(source == quiet_source and text in message
             for quiet_source, text in _QUIET_WARNINGS)


class LineFilter:
  """Keeps a process's output lines but TensorFlow's start-up noise, and
  counts what it left out (everything is kept under `TFPAR_TF_LOGS=1`).

  Example:

  >>> from tfpar.tf_startup_log import LineFilter
  >>> keep = LineFilter(show_all=False)
  >>> [keep(line) for line in ("I0000 00:00:1.5 7 port.cc:1] notice", "hi")]
  [False, True]
  >>> keep.hidden
  1
  """

  def __init__(self, show_all=None):
    self.show_all = shown() if show_all is None else show_all
    self.hidden = 0
    self._lock = threading.Lock()  # Each worker's output has a thread.

  def __call__(self, line):
    if self.show_all or not is_startup_noise(line):
      return True
    with self._lock:
      self.hidden += 1
    return False

  def summary(self, tool):
    """The line saying how many lines `tool` left out, or None."""
    if not self.hidden:
      return None
    return (f"{tool}: left out {self.hidden} lines of TensorFlow's start-up "
            f"log ({SHOW_ENV}=1 shows them)")


@contextlib.contextmanager
def filtered_stderr():
  """Context: what this process writes to its standard error (file
  descriptor 2, where TensorFlow's native libraries write) is held and
  written out at the end, but TensorFlow's start-up noise. For a short step
  that prints nothing the user waits on, such as loading a model."""
  if shown():
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      keep = LineFilter(show_all=False)
      kept = [line for line in held.read().decode("utf-8", "replace")
              .splitlines() if keep(line)]
      if kept:
        sys.stderr.write("\n".join(kept) + "\n")
        sys.stderr.flush()
