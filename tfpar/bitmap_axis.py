"""The value axis of tfpar's bitmap charts (the planner's memory chart,
the monitor's panels): ticks at 1-2-5 steps, their grid lines and labels,
and the axis lines, in the colours both charts use."""

import math

from tfpar import bitmap_font as font

INK = (40, 40, 40)
GRID = (225, 225, 225)


def tick_step(top, ticks):
  """The 1-2-5 step (1, 2, 5, 10, 20, ...) that gives about `ticks` ticks
  from 0 to `top`: the smallest such step of at least `top / ticks`.

  Args:
    top: the largest value the axis must reach (> 0).
    ticks: about how many ticks to draw.

  Example:

  >>> from tfpar.bitmap_axis import tick_step
  >>> tick_step(730, 5), tick_step(9.5, 4)
  (200, 5)
  """
  raw = top / ticks
  power = 10 ** math.floor(math.log10(raw))
  for factor in (1, 2, 5, 10):
    if factor * power >= raw:
      return factor * power
  return 10 * power


def draw_value_axis(image, highest, ticks, label, base, height, left, right):
  """Draws a vertical value axis from 0 at row `base` up `height` rows:
  a grid line and a label (`label(value)`, right-aligned left of `left`)
  at each tick, and the axis lines. Returns the value at the top row, a
  whole number of ticks at or above `highest`.

  Args:
    image: the RGB uint8 array to draw on.
    highest: the largest value to show (> 0).
    ticks: about how many ticks to draw (`tick_step`).
    label: the text of a tick's value.
    base: the row of the value 0.
    height: rows from 0 to the top value.
    left, right: the columns the grid lines span.

  Example:

  >>> import numpy as np
  >>> from tfpar.bitmap_axis import draw_value_axis
  >>> image = np.full((120, 200, 3), 255, np.uint8)
  >>> draw_value_axis(image, 730, 5, str, 110, 100, 40, 190)
  800
  """
  step = tick_step(highest, ticks)
  top_value = step * math.ceil(highest / step)
  for tick in range(int(round(top_value / step)) + 1):
    y = base - int(round(tick * step * height / top_value))
    image[y, left:right] = GRID
    text = label(tick * step)
    font.draw_text(image, text, y - 3, left - 6 - font.text_width(text), INK)
  image[base - height:base + 1, left - 1] = INK
  image[base, left - 1:right] = INK
  return top_value
