"""The monitor's CSV file: one row per report, "unknown" where a number
cannot be known (a stock strategy's bytes, a peak on an unlisted device).
Pure Python, so `tfpar monitor plot` starts without TensorFlow."""

import csv
import os

UNKNOWN = "unknown"


class CsvLog:
  """Appends report rows to `path`, the header first (the columns of the
  first row; a later row's extra keys are left out).

  Args:
    path: the CSV file (overwritten when the first row is written).

  Example:

  >>> import os, tempfile
  >>> path = os.path.join(tempfile.mkdtemp(), "run.csv")
  >>> log = CsvLog(path)
  >>> log.write({"step": 10, "mfu": 0.25, "all-reduce_bytes": None})
  >>> read(path)
  [{'step': 10.0, 'mfu': 0.25, 'all-reduce_bytes': None}]
  """

  def __init__(self, path):
    self.path = path
    self._columns = None

  def write(self, row):
    """Writes one report (a dict; None is written as "unknown")."""
    first = self._columns is None
    if first:
      self._columns = list(row)
      folder = os.path.dirname(self.path)
      if folder:
        os.makedirs(folder, exist_ok=True)
    with open(self.path, "w" if first else "a", newline="") as f:
      writer = csv.writer(f)
      if first:
        writer.writerow(self._columns)
      writer.writerow([UNKNOWN if row.get(c) is None else row.get(c)
                       for c in self._columns])


def _value(text):
  if text in (UNKNOWN, ""):
    return None
  try:
    return float(text)
  except ValueError:
    return text


def read(path):
  """The rows of a monitor CSV: numbers as floats, "unknown" as None.

  Args:
    path: a CSV file `TrainingMonitor` wrote.

  Raises:
    ValueError: the file has no header or no `step` column.
  """
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  if not rows or "step" not in rows[0]:
    raise ValueError(f"{path!r} is not a TrainingMonitor CSV: its first "
                     f"line must be a header with a 'step' column. Received "
                     f"header: {rows[0] if rows else 'an empty file'}")
  header = rows[0]
  return [{name: _value(text) for name, text in zip(header, row)}
          for row in rows[1:]]
