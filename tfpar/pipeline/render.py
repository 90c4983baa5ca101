"""Drawing a schedule trace as a swimlane picture (PNG).

One lane per device (top: the first; under the interleaved schedule a
device's virtual stages share its lane, later ones in darker shades), time
to the right, like the GPipe and
1F1B diagrams: forward work in blue, backward in green, each box labelled
with its micro-batch number, idle time (the bubble) left white. A box is
drawn wherever an op of the work item ran. Drawn with
NumPy and encoded with `tf.io.encode_png`, so no plotting package is needed.
"""

import numpy as np

from tfpar import bitmap_font
from tfpar.pipeline import trace as trace_lib

_FORWARD = np.array([66, 133, 244], np.uint8)
_BACKWARD = np.array([52, 168, 83], np.uint8)
_GRID = np.array([200, 200, 200], np.uint8)


def swimlane_image(trace, replica=0, width=1200, lane_height=36):
  """The picture of one replica's schedule as an RGB uint8 array.

  Args:
    trace: a `ScheduleTrace`.
    replica: which replica's pipeline to draw.
    width: image width in pixels.
    lane_height: pixels per device.
  """
  events = [e for e in trace.events if e.replica == replica]
  start = min(e.start_us for e in events)
  span = max(e.end_us for e in events) - start or 1.0
  margin = 8
  height = trace.pipeline_size * lane_height + 2 * margin
  image = np.full((height, width + 2 * margin, 3), 255, np.uint8)
  scale = max(1, (lane_height - 8) // (2 * bitmap_font.HEIGHT))
  for lane in range(trace.pipeline_size + 1):
    image[margin + lane * lane_height, margin:margin + width] = _GRID
  for event in events:
    top = margin + trace.device_of(event.stage) * lane_height + 2
    bottom = top + lane_height - 4
    color = _FORWARD if event.phase == "forward" else _BACKWARD
    chunk = event.stage // trace.pipeline_size  # Its virtual stage.
    color = (color * 0.7**chunk).astype(np.uint8)
    boxes = []
    for lo, hi in trace_lib.busy_intervals(event):
      left = margin + int((lo - start) / span * width)
      right = max(margin + int((hi - start) / span * width), left + 1)
      image[top:bottom, left:right] = color
      boxes.append((right - left, left, right))
    image[top:bottom, boxes[-1][2] - 1] = 255  # Separates adjacent items.
    _, left, right = max(boxes)  # The label goes in the widest box.
    label = str(event.microbatch)
    label_width = bitmap_font.text_width(label, scale)
    if right - left > label_width + 2:
      bitmap_font.draw_text(
          image, label, top + (lane_height - 4 - bitmap_font.HEIGHT * scale)
          // 2, left + (right - left - label_width) // 2, (255, 255, 255),
          scale)
  return image


def write_png(trace, path, replica=0, width=1200):
  """Writes the swimlane picture of `trace` to `path` (PNG).

  Example:

  >>> from tfpar.pipeline.trace import ScheduleTrace, TraceEvent
  >>> from tfpar.pipeline.render import write_png
  >>> trace = ScheduleTrace([TraceEvent(0, 0, 0, "forward", 0, 1),
  ...                        TraceEvent(0, 1, 0, "forward", 1, 2)])
  >>> write_png(trace, "/tmp/schedule.png")  # doctest: +SKIP
  '/tmp/schedule.png'
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  encoded = tf.io.encode_png(swimlane_image(trace, replica, width))
  tf.io.write_file(path, encoded)
  return path
