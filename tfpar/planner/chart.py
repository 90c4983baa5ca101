"""The planner's picture: memory per device as stacked bars, as a PNG.

Like the seeds' ZeRO chart, for the user's own model: one bar per
candidate, parameters (blue), gradients (amber), optimizer state (green),
activations (purple) and gradient accumulators (orange) stacked, the
memory per device as a red line, the recommended bar framed in black,
each bar labelled with its layout ("NOT YET" under layouts tfpar cannot
run yet) and total (red when it does not fit). Drawn with NumPy and
encoded by `tfpar.png` (zlib), so neither a plotting package nor
TensorFlow is needed.
"""

import numpy as np

from tfpar import bitmap_axis as axis
from tfpar import bitmap_font as font
from tfpar import png
from tfpar.planner import units

PARTS = (("parameters", (66, 133, 244)), ("gradients", (251, 188, 4)),
         ("optimizer", (52, 168, 83)), ("activations", (171, 71, 188)),
         ("accumulators", (255, 112, 67)))
LIMIT = (219, 68, 55)
INK = axis.INK
MUTED = (150, 150, 150)
WHITE = (255, 255, 255)
_PLOT_HEIGHT = 280
_LEFT, _RIGHT, _TOP = 64, 24, 58


def bar_labels(layout):
  """The lines under a bar: degrees, then experts, ZeRO, offload,
  recompute.

  Example:

  >>> from tfpar.planner import Layout
  >>> from tfpar.planner.chart import bar_labels
  >>> bar_labels(Layout(data=16, zero=3, offload="cpu"))
  ['DP16', 'ZERO-3', '+OFFLOAD']
  >>> bar_labels(Layout(data=16, expert=4))
  ['DP16', 'EP4']
  """
  lines = [" ".join([f"DP{layout.data}"] +
                    ([f"TP{layout.tensor}"] if layout.tensor > 1 else []) +
                    ([f"PP{layout.pipeline}"] if layout.pipeline > 1 else []))]
  if layout.expert > 1:
    lines.append(f"EP{layout.expert}")
  if layout.zero:
    lines.append(f"ZERO-{layout.zero}")
  if layout.offload:
    lines.append("+OFFLOAD")
  if layout.recompute:
    lines.append("+RECOMPUTE")
  return lines


def chart_image(result, candidates):
  """The chart as an RGB uint8 array.

  Args:
    result: the `PlanResult` (title, memory per device, recommendation).
    candidates: the `Candidate`s to draw, one bar each, left to right.

  Example:

  >>> import tfpar.planner
  >>> from tfpar.planner.chart import chart_image
  >>> result = tfpar.planner.plan(7.5e9, 64, "32GB", precision="mixed")
  >>> chart_image(result, result.shown()).shape[2]
  3
  """
  labels = [bar_labels(c.layout) for c in candidates]
  totals = [units.format_bytes(c.memory.total).upper() for c in candidates]
  slot = max([font.text_width(line) for lines in labels for line in lines] +
             [font.text_width(t) for t in totals] + [40]) + 12
  bar = slot - 12
  title = (f"MEMORY PER DEVICE: {result.model_name} ON {result.devices} "
           f"DEVICES ({result.precision})")
  legend_width = sum(font.text_width(name) + 24 for name, _ in PARTS)
  width = max(_LEFT + slot * len(candidates) + _RIGHT,
              font.text_width(title, 2) + 20, legend_width + 20)
  lines_below = max(len(lines) + (not c.supported)
                    for lines, c in zip(labels, candidates))
  height = _TOP + 16 + _PLOT_HEIGHT + 10 + 10 * lines_below + 8
  image = np.full((height, width, 3), 255, np.uint8)
  font.draw_text(image, title, 8, 10, INK, scale=2)
  x = 10
  for name, color in PARTS:
    image[30:38, x:x + 8] = color
    font.draw_text(image, name, 31, x + 12, INK)
    x += font.text_width(name) + 24

  base = _TOP + 16 + _PLOT_HEIGHT  # The row under the bars.
  largest = max([c.memory.total for c in candidates] +
                [result.memory_per_device])
  right = _LEFT + slot * len(candidates)
  top_value = axis.draw_value_axis(
      image, largest * 1.05, 5, lambda value: units.format_bytes(value).upper(),
      base, _PLOT_HEIGHT, _LEFT, right)
  pixels = _PLOT_HEIGHT / top_value

  tops = []
  for index, candidate in enumerate(candidates):
    left, top = _LEFT + index * slot + 6, base
    for name, color in PARTS:
      value = getattr(candidate.memory, name)
      if value > 0:
        size = max(1, int(round(value * pixels)))
        image[top - size:top, left:left + bar] = color
        top -= size
    tops.append(top)

  limit_y = base - int(round(result.memory_per_device * pixels))
  image[limit_y - 1:limit_y + 1, _LEFT:right:2] = LIMIT
  limit_text = f"LIMIT {units.format_bytes(result.memory_per_device).upper()}"
  font.draw_text(image, limit_text, limit_y - 10,
                 right - font.text_width(limit_text), LIMIT)

  for index, candidate in enumerate(candidates):
    left, top = _LEFT + index * slot + 6, tops[index]
    center = lambda text: left + (bar - font.text_width(text)) // 2  # pylint: disable=cell-var-from-loop
    image[top - 11:top - 2, left:left + bar] = WHITE
    font.draw_text(image, totals[index], top - 10, center(totals[index]),
                   INK if candidate.fits else LIMIT)
    if candidate is result.recommended:
      _frame(image, top - 14, base, left - 3, left + bar + 3)
      font.draw_text(image, "BEST", top - 22, center("BEST"), INK)
    lines = labels[index] + ([] if candidate.supported else ["NOT YET"])
    for row, line in enumerate(lines):
      font.draw_text(image, line, base + 6 + 10 * row, center(line),
                     INK if row < len(labels[index]) else MUTED)
  return image


def _frame(image, top, bottom, left, right):
  top = max(top, 0)
  image[top, left:right] = INK
  image[top:bottom, left] = INK
  image[top:bottom, right - 1] = INK


def write_png(result, path, candidates):
  """Writes `chart_image(result, candidates)` to `path` (PNG).

  Args:
    result: the `PlanResult`.
    path: the PNG file.
    candidates: the candidates to draw.

  Returns:
    `path`.

  Example:

  >>> import tfpar.planner
  >>> from tfpar.planner.chart import write_png
  >>> result = tfpar.planner.plan(7.5e9, 64, "32GB", precision="mixed")
  >>> write_png(result, "/tmp/plan.png", result.shown())  # doctest: +SKIP
  '/tmp/plan.png'
  """
  data = png.encode(chart_image(result, candidates))
  if "://" in path:  # gs:// and other file systems TensorFlow reaches.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.io.write_file(path, data)
  else:
    with open(path, "wb") as f:
      f.write(data)
  return path
