"""`tfpar monitor plot run.csv`: throughput, MFU and bus bandwidth over
steps, three panels in one PNG. Drawn with matplotlib when it is
installed, else with NumPy and tfpar's bitmap font (the planner's chart
code), so nothing else is needed."""

import numpy as np

from tfpar import bitmap_axis as axis
from tfpar import bitmap_font as font
from tfpar import png
from tfpar.monitor import csv_log

KIND_COLORS = (("all-reduce", (66, 133, 244)), ("all-gather", (52, 168, 83)),
               ("reduce-scatter", (251, 188, 4)),
               ("all-to-all", (171, 71, 188)), ("broadcast", (255, 112, 67)))
LINE = (66, 133, 244)
INK = axis.INK
_WIDTH, _PANEL, _LEFT, _RIGHT, _GAP = 640, 150, 80, 20, 44


def panels(rows):
  """[(title, [(label, color, steps, values)])] of what a CSV holds:
  throughput (tokens per second if known, else samples), MFU in percent,
  and bus bandwidth in GB/s per collective kind that moved bytes.

  Args:
    rows: `csv_log.read`'s rows.

  Example:

  >>> rows = [{"step": 10.0, "samples_per_sec": 5.0, "mfu": 0.5,
  ...          "all-reduce_busbw": 2e9}]
  >>> [(title, [s[0] for s in series]) for title, series in panels(rows)]
  [('SAMPLES/S', ['SAMPLES/S']), ('MFU %', ['MFU']), ('BUS GB/S', ['ALL-REDUCE'])]
  """
  def series(column, scale=1.0):
    points = [(r["step"], r[column] * scale) for r in rows
              if isinstance(r.get(column), float)]
    return [p[0] for p in points], [p[1] for p in points]

  unit = ("tokens_per_sec" if any(isinstance(r.get("tokens_per_sec"), float)
                                  for r in rows) else "samples_per_sec")
  name = "TOKENS/S" if unit == "tokens_per_sec" else "SAMPLES/S"
  result = [(name, [(name, LINE, *series(unit))]),
            ("MFU %", [("MFU", LINE, *series("mfu", 100.0))])]
  lines = []
  for kind, color in KIND_COLORS:
    steps, values = series(f"{kind}_busbw", 1e-9)
    if any(values):
      lines.append((kind.upper(), color, steps, values))
  result.append(("BUS GB/S", lines))
  return result


def _label(value):
  return f"{value:.3g}".upper()


def _draw_line(image, x0, y0, x1, y1, color):
  count = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
  xs = np.linspace(x0, x1, count).round().astype(int)
  ys = np.linspace(y0, y1, count).round().astype(int)
  for dy in (0, 1):
    image[np.clip(ys + dy, 0, image.shape[0] - 1), xs] = color


def image_of(rows):
  """The three panels as an RGB uint8 array (the bitmap drawing).

  Args:
    rows: `csv_log.read`'s rows.
  """
  drawn = panels(rows)
  steps = [s for _, series in drawn for line in series for s in line[2]]
  first, last = (min(steps), max(steps)) if steps else (0.0, 1.0)
  span = (last - first) or 1.0
  height = len(drawn) * (_PANEL + _GAP) + 20
  image = np.full((height, _WIDTH, 3), 255, np.uint8)
  right = _WIDTH - _RIGHT
  for index, (title, series) in enumerate(drawn):
    top = 20 + index * (_PANEL + _GAP)
    base = top + _PANEL
    font.draw_text(image, title, top - 14, 10, INK)
    x = _LEFT + font.text_width(title) + 20
    for label, color, _, _ in series if title.startswith("BUS") else ():
      image[top - 14:top - 7, x:x + 7] = color
      font.draw_text(image, label, top - 14, x + 11, INK)
      x += font.text_width(label) + 24
    values = [v for line in series for v in line[3]]
    if not values:
      font.draw_text(image, "UNKNOWN", top + _PANEL // 2, _LEFT + 10, INK)
    largest = max(values + [0.0]) or 1.0
    top_value = axis.draw_value_axis(image, largest * 1.1, 4, _label, base,
                                     _PANEL, _LEFT, right)
    for _, color, xs, ys in series:
      points = [(_LEFT + (s - first) / span * (right - _LEFT - 1),
                 base - v / top_value * _PANEL) for s, v in zip(xs, ys)]
      for (x0, y0), (x1, y1) in zip(points, points[1:] or points):
        _draw_line(image, x0, y0, x1, y1, color)
    for value, x in ((first, _LEFT), (last, right)):
      text = str(int(value)) if value == int(value) else _label(value)
      left = min(x - font.text_width(text) // 2,
                 _WIDTH - 2 - font.text_width(text))
      font.draw_text(image, text, base + 6, left, INK)
  font.draw_text(image, "STEP", height - 12, _WIDTH // 2, INK)
  return image


def _matplotlib_png(drawn, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  figure, axes = pyplot.subplots(len(drawn), 1, figsize=(8, 7), sharex=True)
  for axis, (title, series) in zip(axes, drawn):
    for label, color, xs, ys in series:
      axis.plot(xs, ys, color=np.array(color) / 255, label=label.lower())
    axis.set_ylabel(title.lower())
    if title.startswith("BUS") and series:
      axis.legend()
    axis.grid(True, alpha=0.3)
  axes[-1].set_xlabel("step")
  figure.tight_layout()
  figure.savefig(path)
  pyplot.close(figure)


def write_png(csv_path, png_path, use_matplotlib=None):
  """Plots a monitor CSV to a PNG.

  Args:
    csv_path: a CSV `TrainingMonitor` wrote.
    png_path: the PNG to write.
    use_matplotlib: True/False to force a drawing; None: matplotlib if
      installed.

  Returns:
    "matplotlib" or "bitmap": how it was drawn.

  Raises:
    ValueError: not a monitor CSV, or no rows in it.

  Example:

  >>> import os, tempfile
  >>> from tfpar.monitor import csv_log
  >>> folder = tempfile.mkdtemp()
  >>> log = csv_log.CsvLog(os.path.join(folder, "run.csv"))
  >>> for step in (10, 20):
  ...   log.write({"step": step, "samples_per_sec": 100.0 + step,
  ...              "mfu": 0.2, "all-reduce_busbw": 1e9})
  >>> write_png(log.path, os.path.join(folder, "run.png"), False)
  'bitmap'
  """
  rows = csv_log.read(csv_path)
  if not rows:
    raise ValueError(f"{csv_path!r} has a header but no report rows: "
                     f"train for at least `every` steps first.")
  if use_matplotlib is None:
    try:
      import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
      use_matplotlib = True
    except ImportError:
      use_matplotlib = False
  if use_matplotlib:
    _matplotlib_png(panels(rows), png_path)
    return "matplotlib"
  with open(png_path, "wb") as f:
    f.write(png.encode(image_of(rows)))
  return "bitmap"
